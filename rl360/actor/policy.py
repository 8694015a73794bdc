"""One rank of the Megatron-core policy: its state (model, reference model, optimizer, offload) and its forward
passes through megatron's schedule (log-probs, micro-batches, the inputs of each). Its other parts are modules of
their own: the model and optimizer built (`policy_model.py`), the update (`policy_update.py`), the weights out
(`policy_export.py`) and the checkpoints (`policy_checkpoints.py`).

Created as a Ray actor by `rl360.cluster`; every rank initialises torch.distributed and megatron parallel
state. Micro-batches go through megatron's own forward-backward schedule, gradients live in megatron's
DistributedDataParallel buffers and the optimizer is megatron's, so the same code runs at TP x PP x DP.
"""

from __future__ import annotations

import contextlib
import os

import torch

from megatron_bridge import Bridge
from megatron_bridge.attention import HostPackedSeqParams
from megatron_bridge.context_parallel import context_group, gather, local_part
from megatron_bridge.layer_spec import auto_reason, resolve_attention
from megatron_bridge.lora import LoraSpec
from rl360.actor.batch import (
    RolloutBatch,
    at_least,
    interleaved_micro_batches,
    interleaving_group,
    micro_batch_rows,
    to_device,
)
from rl360.actor.multimodal import MultimodalInputs
from rl360.actor.offload import StateOffload
from rl360.actor.parallel import init_parallel, unwrap
from rl360.actor.policy_checkpoints import PolicyCheckpoints
from rl360.actor.policy_export import PolicyExport
from rl360.actor.policy_model import (
    DTYPES,
    PolicyModel,
    build_optimizer,
    lora_spec,
    optimizer_tensors,
    routing_replay,
    wrap_ddp,
)
from rl360.actor.policy_update import PolicyUpdate
from rl360.actor.routing_replay import megatron_order
from rl360.actor.settings import PolicySettings
from rl360.actor.vocab_parallel import logprobs_and_entropy, without_padding
from rl360.data.images import VisionProcessor


class PolicyWorker(PolicyModel, PolicyUpdate, PolicyExport, PolicyCheckpoints):
    metric_prefix = "actor"

    def __init__(self, settings: PolicySettings, rank: int = 0, world_size: int = 1,
                 master_addr: str = "127.0.0.1", master_port: int = 0, colocated: bool = False):
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                          MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        if settings.num_threads:
            torch.set_num_threads(settings.num_threads)
        self.settings = settings
        self.colocated = colocated  # the placement's: engines share this rank's GPU and take its memory between calls
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")
        parallel = settings.actor.parallel
        init_parallel(parallel.tensor, parallel.pipeline, seed=settings.seed, context_parallel=parallel.context,
                      virtual_pipeline=parallel.virtual_pipeline, expert_parallel=parallel.expert)
        from megatron.core import parallel_state

        self.context, self.context_group = parallel.context, context_group()
        # every sequence's length a multiple of this: 2 x cp chunks for context parallelism, and the tensor-parallel
        # size for sequence parallelism (megatron scatters the tokens over the tensor-parallel ranks)
        self.sequence_multiple = (2 * parallel.context if parallel.context > 1 else 1) * \
            (parallel.tensor if parallel.sequence else 1)

        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.last_stage = parallel_state.is_pipeline_last_stage()
        self.bridge = Bridge.from_hf_pretrained(settings.model.path)
        self.replay = routing_replay(settings)  # actor.moe_routing_replay: the engine's experts replayed (None: off)
        self.attention = resolve_attention(settings.model.attention)  # the layer spec that runs here (auto decided)
        self.multimodal = self._multimodal_inputs(parallel_state.is_pipeline_first_stage())
        dtype = DTYPES[settings.model.dtype]
        self.lora = self._lora_spec()
        self.models = wrap_ddp(self._build_model(dtype, adapters=True), settings.actor.distributed_optimizer)
        # vocabulary id of this rank's first logit column (the output layer is split over TP, padding last)
        padded_vocab = unwrap(self.models[-1]).vocab_size
        self.vocab_start = parallel_state.get_tensor_model_parallel_rank() * padded_vocab // parallel.tensor
        self.optimizer = build_optimizer(settings, self._optimizer_settings(), self.models)
        self.ref_models = None
        if self._needs_reference():
            self.ref_models = self._build_model(dtype)
            for chunk in self.ref_models:
                chunk.eval().requires_grad_(False)
        self.offload = self._state_offload() if settings.actor.offload else None
        if self.offload is not None:
            self.offload.park()

    def _multimodal_inputs(self, first_stage: bool) -> MultimodalInputs | None:
        """Positions and pixels for a vision-language model's micro-batches (None for a text-only model)."""
        if not self.bridge.arch.vision:
            return None
        model = self.settings.model
        processor = VisionProcessor.from_pretrained(model.path, min_pixels=model.min_pixels or None,
                                                    max_pixels=model.max_pixels or None)
        return MultimodalInputs(processor, self.bridge.image_token_id, first_stage)

    def _state_offload(self) -> StateOffload:
        def parameters(models):
            return lambda: [param for chunk in models for param in chunk.parameters()]

        groups = {"weights": parameters(self.models),
                  "grads": lambda: [buffer.grad_data for chunk in self.models
                                    for buffer in chunk.buffers + chunk.expert_parallel_buffers],
                  "optimizer": lambda: optimizer_tensors(self.optimizer)}
        if self.ref_models is not None:
            groups["reference"] = parameters(self.ref_models)
        return StateOffload(groups, keep_values={"weights": True, "grads": False, "optimizer": True, "reference": True},
                            resident_between_calls=() if self.colocated else ("weights",))

    def state_bytes(self) -> dict[str, int]:
        """Bytes of this rank's weights, gradients, optimizer state and reference model (offloaded or not)."""
        return (self.offload or self._state_offload()).total_bytes()

    def _resident(self, *groups: str):
        """A context in which `groups` of this rank's state are in device memory (see rl360/actor/offload.py)."""
        return self.offload.using(*groups) if self.offload is not None else contextlib.nullcontext()

    def _optimizer_settings(self):
        """lr, weight_decay, betas and grad_clip of this model's optimizer."""
        return self.settings.actor

    def _lora_spec(self) -> LoraSpec | None:
        """The adapters this model trains (actor.lora; None: the whole model trains)."""
        return lora_spec(self.settings)

    def _needs_reference(self) -> bool:
        return self.settings.algorithm.kl_coef > 0 or self.settings.algorithm.kl_in_reward_coef > 0

    def attention_backend(self) -> str:
        """The layer spec this rank runs: te, torch or local (`model.attention=auto` resolved)."""
        return self.attention

    def attention_reason(self) -> str:
        """Which spec `model.attention=auto` picks on this rank's machine, and why."""
        return auto_reason()

    def layout(self) -> dict[str, int | bool]:
        """Where this rank sits: its data-parallel index, and whether it returns results (the first
        tensor- and context-parallel rank of the last pipeline stage) and takes part in weight export (replica 0;
        with expert parallelism the ranks of the first expert-data-parallel replica, which together hold every
        expert)."""
        from megatron.core import parallel_state

        dp_rank = parallel_state.get_data_parallel_rank()
        exports = parallel_state.get_expert_data_parallel_rank() == 0 if self.settings.actor.parallel.expert > 1 \
            else dp_rank == 0
        return {"dp_rank": dp_rank, "dp_size": self.dp_size, "exports": exports,
                "returns": self.last_stage and parallel_state.get_tensor_model_parallel_rank() == 0
                and parallel_state.get_context_parallel_rank() == 0}

    # ---- forward passes -------------------------------------------------------------------------

    def compute_logprobs(self, batch: RolloutBatch, reference: bool = False) -> torch.Tensor | None:
        """[B, R] log-probs of the response tokens under the policy (or the reference model); None on
        ranks other than the last pipeline stage."""
        models = self.ref_models if reference else self.models
        if models is None:
            raise RuntimeError("no reference model: algorithm.kl_coef is 0")
        micro = self._micro_batches(batch)

        def collect(logits: torch.Tensor, mb: RolloutBatch, non_loss_data: bool = True):
            logprobs, _ = self._logprobs_and_entropy(logits, mb, with_entropy=False)
            return logprobs.detach()

        with torch.no_grad(), self._resident("reference" if reference else "weights"):
            outputs = self._schedule(models, micro, collect, forward_only=True)
        return self._in_batch_order(outputs).cpu() if self.last_stage else None

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits of the current policy for right-padded `input_ids` (tests and eval at
        TP = PP = 1)."""
        parallel = self.settings.actor.parallel
        if parallel.tensor * parallel.pipeline * parallel.expert != 1:
            raise NotImplementedError("PolicyWorker.logits runs at TP = PP = EP = 1 only")
        input_ids = input_ids.to(self.device)
        positions = torch.arange(input_ids.shape[1], device=self.device).expand_as(input_ids)
        if self.multimodal is not None:  # text: the same position on M-RoPE's three axes
            positions = positions.expand(3, -1, -1)
        with torch.no_grad(), self._resident("weights"):
            logits = unwrap(self.models[0])(input_ids, positions, None)
        return logits[..., :self.bridge.vocab_size].float().cpu()

    # ---- megatron schedule ------------------------------------------------------------------------

    @property
    def temperature(self) -> float:
        """The sampling temperature the log-probs are of (the engines': rollout.temperature)."""
        return self.settings.temperature

    @property
    def micro_batch_size(self) -> int:
        """Responses per forward/backward pass of this model."""
        return self.settings.actor.micro_batch_size

    def _micro_batches(self, batch: RolloutBatch) -> list[RolloutBatch]:
        """`batch` in micro-batches (by count, or by `actor.max_tokens_per_micro_batch`), each cut to its
        longest row; `_in_batch_order` puts their per-row results back in `batch`'s order."""
        rows = micro_batch_rows(batch.sequence_lengths(), self.micro_batch_size,
                                self.settings.actor.max_tokens_per_micro_batch, self.settings.actor.pack_sequences)
        if self.settings.actor.parallel.expert > 1:  # every layer's all-to-all needs each EP rank's micro-batch
            rows = at_least(rows, self._expert_parallel_max(len(rows)))
        if len(self.models) > 1:  # virtual pipeline stages: enough micro-batches for the interleaved schedule
            rows = at_least(rows, interleaved_micro_batches(len(rows), self.settings.actor.parallel.pipeline,
                                                            len(self.models)))
        self._micro_rows = torch.cat(rows)
        return [batch.select(group).cropped() for group in rows]

    def _expert_parallel_max(self, count: int) -> int:
        """The largest `count` of the expert-parallel ranks (token budgets can split their shards differently)."""
        from megatron.core import parallel_state

        most = torch.tensor([count], dtype=torch.long, device=self.device)
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX,
                                     group=parallel_state.get_expert_model_parallel_group())
        return int(most.item())

    def _in_batch_order(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        """Per-row results of the last `_micro_batches` split, concatenated in the batch's row order."""
        joined = torch.cat(outputs, dim=0)
        result = torch.empty_like(joined)
        result[self._micro_rows.to(joined.device)] = joined
        return result

    def _schedule(self, models, micro: list[RolloutBatch], on_logits, forward_only: bool) -> list:
        """Run megatron's forward-backward schedule; `on_logits(logits, mb)` is the loss (or collector)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        replaying = self.replay is not None and models is self.models and micro[0].routed_experts is not None

        def forward_step(data_iterator, model):
            mb, input_ids, positions, packing, lengths, vision_inputs = self._step_inputs(next(data_iterator))
            if replaying:  # the engine's experts for these tokens, in the order this chunk's routers see them
                self.replay.replay(model, megatron_order(mb, input_ids.shape[1], self.replay.num_layers,
                                                         self.replay.top_k, lengths if packing is not None else None))
            if self.context > 1:  # this rank's 1/cp of every sequence, and the token each position predicts
                labels = local_part(torch.roll(input_ids, -1, dims=1), 1, lengths, self.context_group)
                input_ids, positions = (local_part(x, 1, lengths, self.context_group) for x in (input_ids, positions))
            # the last stage's logits (earlier stages and chunks: hidden states)
            output = model(input_ids, positions, None, packed_seq_params=packing, **vision_inputs)
            if unwrap(model).post_process:
                output = self._head_output(output)
                if self.context > 1:
                    output = gather(self._per_token(output, labels, with_entropy=not forward_only), 1, lengths,
                                    self.context_group)
            if forward_only:
                return output, lambda out, non_loss_data=True: on_logits(out, mb)
            return output, lambda out: on_logits(out, mb)

        width = max(mb.input_ids.shape[1] for mb in micro)
        data = iter(micro)
        if len(models) > 1:  # virtual pipeline: each chunk reads every micro-batch through its own iterator
            data = [iter(micro) for _ in models]
            models[0].config.microbatch_group_size_per_vp_stage = interleaving_group(
                len(micro), self.settings.actor.parallel.pipeline)
        try:
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=data,
                model=models,
                num_microbatches=len(micro),
                seq_length=width,
                micro_batch_size=max(len(mb) for mb in micro),
                forward_only=forward_only,
                collect_non_loss_data=forward_only,
            )
        finally:
            if replaying:
                self.replay.clear(models)

    def _step_inputs(self, host: RolloutBatch):
        """One micro-batch's model inputs: its tensors on the device, token ids and positions (padded, or packed
        in one row with `PackedSeqParams`), the sequence lengths (Python ints) and the vision inputs. Everything
        that depends on the rows' lengths is computed from the host copy before the copies to the device (which
        do not block), so preparing a micro-batch never waits for the device."""
        def device(tensor: torch.Tensor) -> torch.Tensor:
            return to_device(tensor, self.device)

        host = host.to("cpu")  # a no-op for the controller's batches
        mb = host.to(self.device, non_blocking=True)
        packing = None
        if self.settings.actor.pack_sequences:  # one row, sequences back to back, attention within each
            row = host.packing(multiple=self.sequence_multiple)
            input_ids, positions, lengths = row.input_ids, row.positions, row.lengths
            starts = device(row.cu_seqlens)
            packing = HostPackedSeqParams(qkv_format="thd", cu_seqlens_q=starts, cu_seqlens_kv=starts,
                                          max_seqlen_q=row.max_length, max_seqlen_kv=row.max_length,
                                          host_bounds=tuple(row.cu_seqlens.tolist()))
            mb.logit_index = (torch.zeros(len(mb), 1, dtype=torch.long, device=self.device),
                              device(row.response_positions))
        else:
            input_ids = _pad_to_multiple(host.input_ids, self.sequence_multiple)
            lengths = [input_ids.shape[1]]  # each row one sequence
            positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
            mb.logit_index = (torch.arange(len(mb), device=self.device)[:, None], device(host.response_positions()))
        vision_inputs = {}
        if self.multimodal is not None:
            packed_lengths = lengths if self.settings.actor.pack_sequences else None
            positions = self.multimodal.positions(host, input_ids, packed_lengths)
            vision_inputs = {name: device(value) for name, value in
                             self.multimodal.model_inputs(host, input_ids, packed_lengths, "cpu").items()}
        return mb, device(input_ids), device(positions.contiguous()), packing, lengths, vision_inputs

    def _head_output(self, logits: torch.Tensor) -> torch.Tensor:
        """This tensor-parallel rank's slice of the vocabulary's logits, without the bridge's padding
        columns; never gathered (see `rl360.actor.vocab_parallel`)."""
        return without_padding(logits, self.bridge.vocab_size, self.vocab_start)

    def _per_token(self, logits: torch.Tensor, labels: torch.Tensor, with_entropy: bool) -> torch.Tensor:
        """Context parallelism: the log-prob of each position's next token and the entropy there ([..., 2]),
        computed on this rank's positions before they are gathered (the logits themselves never are)."""
        logprobs, entropy = logprobs_and_entropy(logits.float() / self.temperature, labels,
                                                 self.vocab_start, with_entropy)
        return torch.stack([logprobs, entropy if entropy is not None else torch.zeros_like(logprobs)], dim=-1)

    def _response_index(self, output: torch.Tensor, mb: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Index of `output` ([B, T, ...], or [1, T, ...] packed) at the positions that predict each response
        token: [B, R, ...]. A micro-batch from `_step_inputs` carries it, computed on the host."""
        index = getattr(mb, "logit_index", None)
        if index is not None:
            return index
        if self.settings.actor.pack_sequences:
            positions = mb.packed_response_positions(multiple=self.sequence_multiple)
            return torch.zeros(len(mb), 1, dtype=torch.long, device=output.device), positions
        return torch.arange(output.shape[0], device=output.device)[:, None], mb.response_positions()

    def _logprobs_and_entropy(self, logits: torch.Tensor, mb: RolloutBatch,
                              with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, R] log-probs of the response tokens under softmax(logits / temperature) (0 past each
        response) and the entropy of that distribution at each response position."""
        index = self._response_index(logits, mb)
        if self.context > 1:  # already per token (`_per_token`), gathered over the context-parallel ranks
            picked = logits[index]
            logprobs, entropy = picked[..., 0], (picked[..., 1] if with_entropy else None)
        else:
            response_logits = logits[index].float() / self.temperature
            logprobs, entropy = logprobs_and_entropy(response_logits, mb.response_ids, self.vocab_start,
                                                     with_entropy)
        return logprobs * (mb.response_mask > 0), entropy



def _pad_to_multiple(input_ids: torch.Tensor, multiple: int) -> torch.Tensor:
    """Right-pad [B, S] ids with 0 to a width that is a multiple of `multiple`."""
    extra = -input_ids.shape[1] % multiple
    return torch.nn.functional.pad(input_ids, (0, extra)) if extra else input_ids





