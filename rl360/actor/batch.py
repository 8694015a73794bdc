"""The tensor layout the actor trains on, built from sampled rollouts.

Each row is one prompt+response sequence, right-padded to a common length (a vision-language row also
carries its prompt's compressed images, decoded to pixels only on the ranks that run the vision tower).
Response token j of row i sits at `input_ids[i, response_start[i] + j]`; the logits that predict it are at position
`response_start[i] + j - 1`. Per-response quantities (log-probs, advantages, masks) are `[batch, R]` with
R the longest response, zero past each response's end.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor  # [B, T] long
    response_start: torch.Tensor  # [B] long: index of the first response token
    response_ids: torch.Tensor  # [B, R] long
    response_mask: torch.Tensor  # [B, R] float: 1 on response tokens trained on (0: padding, tool tokens)
    rollout_logprobs: torch.Tensor  # [B, R] float: the engine's log-probs of the sampled tokens
    advantages: torch.Tensor | None = None  # [B, R]
    old_logprobs: torch.Tensor | None = None  # [B, R] trainer log-probs before the update
    ref_logprobs: torch.Tensor | None = None  # [B, R] reference-model log-probs
    values: torch.Tensor | None = None  # [B, R] critic values before the update (PPO)
    returns: torch.Tensor | None = None  # [B, R] value targets (PPO)
    teacher_logprobs: torch.Tensor | None = None  # [B, R] a distillation teacher's log-probs of the sampled tokens
    # [B, T, layers * top_k] int16: the engine's experts for each token, -1 where it ran none (MoE routing replay;
    # rl360.actor.routing_replay)
    routed_experts: torch.Tensor | None = None
    images: list[tuple[bytes, ...]] | None = None  # [B] each row's prompt images, compressed (() for none)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: torch.Tensor | slice) -> RolloutBatch:
        """The rows `rows` of every tensor (and of `images`)."""
        batch = self._map(lambda tensor: tensor[rows])
        if self.images is not None:
            batch.images = [self.images[row] for row in torch.arange(len(self))[rows].reshape(-1).tolist()]
        return batch

    def to(self, device: torch.device | str, non_blocking: bool = False) -> RolloutBatch:
        """Every tensor moved to `device`; `non_blocking`: see `to_device`."""
        return self._map(lambda tensor: to_device(tensor, device) if non_blocking else tensor.to(device))

    @property
    def has_images(self) -> bool:
        return self.images is not None and any(self.images)

    def _map(self, fn) -> RolloutBatch:
        """`fn` applied to every tensor; `images` (not a tensor) carried as it is."""
        return RolloutBatch(**{f.name: getattr(self, f.name) if f.name == "images" or getattr(self, f.name) is None
                               else fn(getattr(self, f.name)) for f in fields(self)})

    def sequence_lengths(self) -> torch.Tensor:
        """[B] tokens of each row up to its last trained response token, prompt included."""
        slots = torch.arange(1, self.response_mask.shape[1] + 1, device=self.response_mask.device)
        return self.response_start + ((self.response_mask > 0) * slots).amax(-1)

    def cropped(self) -> RolloutBatch:
        """The same rows with `input_ids` cut to the longest row's length (causal attention: the padding on
        the right changes nothing before it)."""
        width = max(int(self.sequence_lengths().max()), 1)
        batch = self._map(lambda tensor: tensor)
        batch.input_ids = self.input_ids[:, :width]
        return batch

    def response_positions(self) -> torch.Tensor:
        """[B, R] positions of the logits that predict each response token (clamped inside the row)."""
        offsets = torch.arange(self.response_ids.shape[1], device=self.response_ids.device)
        return (self.response_start[:, None] + offsets[None, :] - 1).clamp(max=self.input_ids.shape[1] - 1)

    def packing(self, multiple: int = 1) -> PackedRow:
        """`packed(multiple)`, the slot lengths as Python ints and the packed response positions in one go. Called
        on a batch in host memory (before it goes to the device) it reads no device tensor: the step that moves
        the result to a GPU never waits for it."""
        slots = self._packed_lengths(multiple)
        input_ids, positions, starts = self.packed(multiple)
        lengths = slots.tolist()
        return PackedRow(input_ids, positions, starts, lengths, max(lengths, default=0),
                         self.packed_response_positions(multiple))

    def packed(self, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows back to back in one row, each cut to its length (`sequence_lengths`) rounded up to a
        `multiple` (padded with 0): input_ids [1, T], position_ids [1, T] (from 0 in each sequence) and
        cu_seqlens [B + 1] (int32: where each one starts)."""
        lengths = self.sequence_lengths().tolist()
        slots = self._packed_lengths(multiple).tolist()
        input_ids = torch.cat([torch.nn.functional.pad(self.input_ids[row, :length], (0, slot - length))
                               for row, (length, slot) in enumerate(zip(lengths, slots))])
        positions = torch.cat([torch.arange(slot, device=self.input_ids.device) for slot in slots])
        starts = torch.tensor([0, *slots], device=self.input_ids.device).cumsum(0).to(torch.int32)
        return input_ids[None], positions[None], starts

    def packed_response_positions(self, multiple: int = 1) -> torch.Tensor:
        """[B, R] positions in the packed row (`packed(multiple)`) of the logits that predict each response token."""
        slots = self._packed_lengths(multiple)
        starts = torch.cumsum(slots, 0) - slots
        offsets = torch.arange(self.response_ids.shape[1], device=self.response_ids.device)
        positions = starts[:, None] + self.response_start[:, None] + offsets[None, :] - 1
        return positions.clamp(max=int(slots.sum()) - 1)

    def _packed_lengths(self, multiple: int) -> torch.Tensor:
        lengths = self.sequence_lengths()
        return lengths + (-lengths) % multiple


@dataclass
class PackedRow:
    """A micro-batch's rows back to back in one row (`RolloutBatch.packing`)."""

    input_ids: torch.Tensor  # [1, T] long
    positions: torch.Tensor  # [1, T] long: from 0 in each sequence
    cu_seqlens: torch.Tensor  # [B + 1] int32: where each sequence starts, then T
    lengths: list[int]  # [B] tokens of each sequence's slot (a multiple of the packing multiple)
    max_length: int  # the longest slot
    response_positions: torch.Tensor  # [B, R] long: positions of the logits that predict each response token


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor` on `device`. From host memory to a GPU the copy goes through pinned memory and does not block:
    a copy from pageable memory waits for all the work already queued on the device."""
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def build_batch(prompts: list[list[int]], responses: list[list[int]], logprobs: list[list[float]],
                pad_id: int = 0, images: list[tuple[bytes, ...] | None] | None = None,
                loss_masks: list[list[int] | None] | None = None,
                routed_experts: list[torch.Tensor] | None = None) -> RolloutBatch:
    """Pack prompt/response token lists (one entry per sample) into a `RolloutBatch`; `images`: each sample's
    prompt images (None or () for a text prompt), kept only when some sample has images; `loss_masks`: each
    sample's per-response-token loss mask (`Sample.mask()`: 0 on tokens a tool inserted; None: all trained on),
    which becomes its `response_mask` (the inserted tokens stay in `input_ids`, as context); `routed_experts`:
    each sample's engine routes (`Sample.routed_experts`), -1 at positions the engine did not run."""
    count = len(prompts)
    width = max(len(p) + len(r) for p, r in zip(prompts, responses))
    resp_width = max(max(len(r) for r in responses), 1)
    input_ids = torch.full((count, width), pad_id, dtype=torch.long)
    response_ids = torch.full((count, resp_width), pad_id, dtype=torch.long)
    response_mask = torch.zeros((count, resp_width))
    rollout_logprobs = torch.zeros((count, resp_width))
    for row, (prompt, response, lps) in enumerate(zip(prompts, responses, logprobs)):
        input_ids[row, :len(prompt) + len(response)] = torch.tensor(prompt + response, dtype=torch.long)
        response_ids[row, :len(response)] = torch.tensor(response, dtype=torch.long)
        mask = loss_masks[row] if loss_masks is not None else None
        if mask is None:
            response_mask[row, :len(response)] = 1.0
        elif len(mask) != len(response):
            raise ValueError(f"sample {row}: a loss mask of {len(mask)} tokens for a response of {len(response)}")
        else:
            response_mask[row, :len(response)] = torch.tensor(mask, dtype=torch.float32)
        rollout_logprobs[row, :len(response)] = torch.tensor(lps, dtype=torch.float32)
    response_start = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    kept = [tuple(row or ()) for row in images] if images is not None and any(images) else None
    batch = RolloutBatch(input_ids, response_start, response_ids, response_mask, rollout_logprobs, images=kept)
    if routed_experts:
        batch.routed_experts = _routes_table(routed_experts, width)
    return batch


def _routes_table(routes: list[torch.Tensor], width: int) -> torch.Tensor:
    """`[B, width, layers * top_k]` int16: each sample's routes from its first token, -1 where the engine ran none
    (a response's last token, padding)."""
    table = torch.full((len(routes), width, routes[0].shape[1]), -1, dtype=torch.int16)
    for row, values in enumerate(routes):
        table[row, :len(values)] = values
    return table


def micro_batch_rows(lengths: torch.Tensor, size: int, max_tokens: int = 0,
                     packed: bool = False) -> list[torch.Tensor]:
    """The rows of each micro-batch. `max_tokens` 0: `size` rows each, in order. Otherwise rows longest first,
    each micro-batch as many as fit in `max_tokens` tokens: padded (rows x its longest row), or `packed` (the
    sum of their lengths); a row longer than the budget is a micro-batch of its own."""
    if not max_tokens:
        return [torch.arange(start, min(start + size, len(lengths))) for start in range(0, len(lengths), size)]
    order = torch.sort(lengths, descending=True, stable=True).indices
    groups: list[list[int]] = []
    used = 0  # the last group's real tokens
    for row in order.tolist():
        length = int(lengths[row])
        if groups:
            tokens = used + length if packed else (len(groups[-1]) + 1) * int(lengths[groups[-1][0]])
            if tokens <= max_tokens:
                groups[-1].append(row)
                used += length
                continue
        groups.append([row])
        used = length
    return [torch.tensor(group) for group in groups]


def at_least(groups: list[torch.Tensor], count: int) -> list[torch.Tensor]:
    """`groups` of rows split until there are at least `count` of them: the largest group halved each time (the
    gradient does not depend on how rows are grouped; the groups keep their order). The schedules that need it:
    expert parallelism (every EP rank as many micro-batches as the others) and virtual pipeline stages (see
    `interleaved_micro_batches`). A batch of fewer than `count` rows is a `ValueError`."""
    groups = list(groups)
    while len(groups) < count:
        largest = max(range(len(groups)), key=lambda i: len(groups[i]))
        if len(groups[largest]) < 2:
            rows = sum(len(group) for group in groups)
            raise ValueError(f"{rows} rows on this rank cannot make {count} micro-batches (expert parallelism and "
                             "virtual pipeline stages need that many per mini-batch: give each rank more rows)")
        group = groups.pop(largest)
        half = (len(group) + 1) // 2
        groups[largest:largest] = [group[:half], group[half:]]
    return groups


def interleaved_micro_batches(count: int, pipeline: int, chunks: int) -> int:
    """The fewest micro-batches, `count` or more, that megatron's interleaved schedule runs with variable shapes:
    at least one per pipeline stage, and more than the first stage's warm-up forward passes. When all of a stage's
    passes are warm-up, it exchanges only activations while its neighbour, already in the steady state, waits in
    a shape exchange for a gradient that comes later: a deadlock on gloo and NCCL alike."""
    count = max(count, pipeline)
    while count * chunks <= 2 * (pipeline - 1) + (chunks - 1) * interleaving_group(count, pipeline):
        count += 1
    return count


def interleaving_group(num_micro: int, pipeline: int) -> int:
    """Micro-batches megatron's interleaved schedule runs through one virtual stage before the next: the pipeline
    size when it divides the count (the schedule's default), else the smallest size it accepts (between the
    pipeline size and the count, leaving no last group smaller than the pipeline)."""
    return next(size for size in range(pipeline, num_micro + 1)
                if num_micro % size == 0 or num_micro % size >= pipeline)
