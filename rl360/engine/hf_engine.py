"""The embedded rollout engine: Hugging Face transformers, in-process, CPU or GPU.

Sampling is a plain KV-cached decode loop over a left-padded batch, so the log-prob of every sampled
token comes from exactly the distribution it was drawn from (frequency / presence / repetition penalties and
temperature applied, before top-k/top-p; rl360/engine/penalties.py).
Temperature 0 decodes greedily (the most likely token at every step, no randomness); its log-probs are
those of the model's plain distribution (temperature 1). A row ends at a stop token (`stop_token_ids`) or at the
token whose text completes a stop string (`stop`, decoded incrementally by the checkpoint's tokenizer, loaded at
the first call that has stop strings: rl360/engine/stop_strings.py); the sample's `stop_matched` names the string.

Vision-language checkpoints (config `model_type` qwen2_vl / qwen2_5_vl) load as transformers' image-text-to-text
model and sample from `ImagePrompt`s as well as from token ids, mixed in one batch. An image prompt's ids carry
each image already expanded (the image pad token once per merged patch); its compressed images are decoded by
`rl360.data.images.VisionProcessor.pixel_inputs`, the one pixel pipeline the trainer uses too. The prefill runs
the vision tower once per distinct prompt (a prompt's `n` samples share it) and scatters its features into the
pad tokens' embeddings, which the first forward takes in place of the ids (an input every transformers
release's Qwen-VL forward has, unlike precomputed-feature arguments). Positions are M-RoPE's three rows
(temporal, height, width), computed by the model's own `get_rope_index` over the left-padded batch and passed
explicitly, and every decoded token takes the next position after the largest of its row's prompt positions, as
a full forward of prompt + response gives it.

Weights arrive by Hugging Face checkpoint (file) name, e.g. `model.layers.0.self_attn.q_proj.weight`,
`visual.blocks.0.attn.qkv.weight`, `lm_head.weight`, and are renamed to the model's parameters (transformers 5
nests a VL model's parts as `model.language_model.*`, `model.visual.*`) by transformers' own checkpoint
conversion mapping for the class, the one `from_pretrained` applies (before transformers 5: the class's
`_checkpoint_conversion_mapping` patterns); the parameter names themselves and tied aliases are accepted too
(`parameter_name`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rl360.core import ImagePrompt, Prompt, Sample, SamplingParams, prompt_ids
from rl360.core.wire import WeightBucket
from rl360.engine.penalties import PenaltyState
from rl360.engine.routes import RouteRecorder, sequence_routes
from rl360.engine.stop_strings import StopMatcher

VISION_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")  # config model_type of the vision-language models served


@dataclass
class Prefill:
    """A left-padded batch ready for its first forward: token ids, attention mask, positions ((B, W), or (3, B, W)
    for M-RoPE) and, for a batch with images, the token embeddings with the images' features in place of their
    image tokens (`embeds`), which the first forward takes instead of the ids."""

    ids: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    embeds: torch.Tensor | None = None

    def first_inputs(self) -> dict[str, torch.Tensor]:
        """The token input of the first forward: the embeddings when there are images, else the ids."""
        return {"input_ids": self.ids} if self.embeds is None else {"inputs_embeds": self.embeds}


class HFEngine:
    def __init__(self, model_path: str, dtype: torch.dtype = torch.float32, device: str | None = None,
                 num_threads: int = 0, min_pixels: int | None = None, max_pixels: int | None = None):
        if num_threads:
            torch.set_num_threads(num_threads)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model_path = model_path
        self._tokenizer: Any = None  # loaded for the first call with stop strings
        config = AutoConfig.from_pretrained(model_path)
        self.vision = None  # the VisionProcessor of a vision-language model
        self.image_token_id: int | None = None
        if config.model_type in VISION_MODEL_TYPES:
            from transformers import AutoModelForImageTextToText

            from rl360.data.images import VisionProcessor

            self.vision = VisionProcessor.from_pretrained(model_path, min_pixels=min_pixels, max_pixels=max_pixels)
            self.image_token_id = int(config.image_token_id)
            model_class = AutoModelForImageTextToText
        elif min_pixels is not None or max_pixels is not None:
            raise ValueError(f"min_pixels/max_pixels apply to vision-language models; {model_path} is a "
                             f"{config.model_type!r} model")
        else:
            model_class = AutoModelForCausalLM
        self.model = model_class.from_pretrained(model_path, dtype=dtype).to(self.device).eval()
        self.pad_id = 0
        self.version = 0
        self._params = dict(self.model.named_parameters())
        first_name = {id(param): name for name, param in self._params.items()}
        # every name of a parameter (tied ones too) -> its first name
        self._aliases = {name: first_name[id(param)]
                         for name, param in self.model.named_parameters(remove_duplicate=False)}
        self._names: dict[str, str] = {}  # incoming weight name -> parameter, as resolved so far
        self._loaded: set[str] = set()
        self._pieces: dict[str, set[tuple[int, int]]] = {}  # fused experts: the (expert, first row) pieces loaded
        self.routes = RouteRecorder(self.model)  # a mixture of experts' routes, recorded when a call asks

    # ---- sampling ----
    @torch.no_grad()
    def generate(self, prompts: list[Prompt], params: SamplingParams) -> list[list[Sample]]:
        if params.temperature < 0:
            raise ValueError(f"temperature={params.temperature} must be >= 0 (0: greedy decoding)")
        expanded = [p for p in prompts for _ in range(params.n)]
        generator = torch.Generator(device=self.device).manual_seed(params.seed)
        routes: list[torch.Tensor] | None = [] if params.routed_experts and self.routes.has_experts else None
        tokens, logprobs, finished, matched = self._decode(expanded, params, generator, routes)
        samples = []
        for i, prompt in enumerate(expanded):
            length = int(finished[i]) if finished[i] > 0 else tokens.shape[1]
            samples.append(Sample(
                routed_experts=None if routes is None else sequence_routes(routes[0], routes[1:], i, len(prompt),
                                                                           length),
                prompt_ids=list(prompt_ids(prompt)),
                response_ids=tokens[i, :length].tolist(),
                logprobs=logprobs[i, :length].tolist(),
                finish_reason="stop" if finished[i] > 0 else "length",
                weight_version=self.version,
                images=prompt.images if isinstance(prompt, ImagePrompt) else None,
                stop_matched=matched[i],
            ))
        return [samples[i * params.n:(i + 1) * params.n] for i in range(len(prompts))]

    def _decode(self, prompts: list[Prompt], params: SamplingParams, generator: torch.Generator,
                routes: list[torch.Tensor] | None = None):
        """`routes`: a list to which each forward's `[batch, width, layers, top_k]` routes are appended (None: no
        recording)."""
        batch = self.prefill(prompts)
        mask, positions, step_inputs = batch.mask, batch.positions, batch.first_inputs()
        stop = torch.tensor(params.stop_token_ids or [-1], device=self.device)
        # finished[i] = response length once a stop token was sampled, 0 while still running
        finished = torch.zeros(len(prompts), dtype=torch.long, device=self.device)
        tokenizer = self.tokenizer() if params.stop else None
        matchers = [StopMatcher(tokenizer, params.stop) for _ in prompts] if params.stop else None
        matched: list[str | None] = [None] * len(prompts)
        out_tokens, out_logprobs = [], []
        cache = penalties = None
        for step in range(params.max_new_tokens):
            with self.routes.forward(len(prompts), mask.shape[1] if step == 0 else 1) if routes is not None \
                    else contextlib.nullcontext() as recorded:
                output, cache = cached_forward(self.model, cache, attention_mask=mask, position_ids=positions,
                                               **step_inputs)
            if routes is not None:
                routes += recorded
            logits = output.logits[:, -1, :].float()
            if step == 0:  # frequency / presence / repetition penalties (None: all off)
                penalties = PenaltyState.start([prompt_ids(p) for p in prompts], params, logits.shape[-1],
                                               logits.device)
            if penalties is not None:
                logits = penalties.apply(logits)
            if params.temperature > 0:
                logits = logits / params.temperature
                token = torch.multinomial(_filtered_probs(logits, params), 1, generator=generator).squeeze(-1)
            else:  # greedy
                token = logits.argmax(dim=-1)
            logp = torch.log_softmax(logits, dim=-1)
            running = finished == 0
            token = torch.where(running, token, torch.full_like(token, self.pad_id))
            out_tokens.append(token)
            out_logprobs.append(torch.where(running, logp.gather(-1, token[:, None]).squeeze(-1), 0.0))
            finished = torch.where(running & torch.isin(token, stop), step + 1, finished)
            if matchers is not None:  # stop strings, on the rows still running
                for i, (value, ended) in enumerate(zip(token.tolist(), finished.tolist())):
                    match = matchers[i].push(value)[1] if ended == 0 and matched[i] is None else None
                    if match is not None:
                        finished[i], matched[i] = step + 1, match.string
            if penalties is not None:
                penalties.add(token, running)
            if bool((finished > 0).all()):
                break
            step_inputs = {"input_ids": token[:, None]}
            mask = torch.cat([mask, running.long()[:, None]], dim=-1)
            positions = next_positions(positions)
        return torch.stack(out_tokens, 1).cpu(), torch.stack(out_logprobs, 1).cpu(), finished.cpu(), matched

    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer (for stop strings), loaded once; ValueError when the checkpoint has none."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            except (OSError, ValueError, TypeError) as err:
                raise ValueError(f"stop strings need the tokenizer of {self.model_path}, which cannot be loaded "
                                 f"({err}); use stop_token_ids") from None
        return self._tokenizer

    def prefill(self, prompts: list[Prompt], pixels: list[dict | None] | None = None) -> Prefill:
        """The left-padded batch of `prompts` (token ids or `ImagePrompt`s, mixed) with its positions and, when
        there are images, its token embeddings with the images' features in their image tokens' places.
        `pixels`: the image prompts' pixel inputs when already computed (`pixel_inputs`; rows sharing one dict
        share its features), else None. ValueError naming the prompt when an image prompt does not fit this
        engine (a text model, or image tokens that do not match its images)."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt_ids(prompt))
            mask[row, width - len(prompt):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        if self.vision is None:
            for index, prompt in enumerate(prompts):
                if isinstance(prompt, ImagePrompt):
                    raise ValueError(f"prompt {index} has {len(prompt.images)} image(s) but the engine's model is a "
                                     f"text model ({self.model.config.model_type})")
            return Prefill(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0))
        features, grids = self._image_features(prompts, pixels or [None] * len(prompts))
        grid = torch.cat(grids).to(self.device) if grids else None
        positions = self._rope_index(ids, mask, grid)
        if not features:
            return Prefill(ids, mask, positions)
        embeds = self.model.get_input_embeddings()(ids)
        image_rows = torch.cat(features).to(device=embeds.device, dtype=embeds.dtype)
        embeds = embeds.masked_scatter((ids == self.image_token_id)[..., None].expand_as(embeds), image_rows)
        return Prefill(ids, mask, positions, embeds)

    def _rope_index(self, ids: torch.Tensor, mask: torch.Tensor, grid: torch.Tensor | None) -> torch.Tensor:
        """M-RoPE positions (3, B, W) of a left-padded batch, by the model's own `get_rope_index`. Releases
        before transformers 5 take no `mm_token_type_ids` (they find images by the image token themselves)."""
        rope_index = self.model.model.get_rope_index
        extra = {}
        if "mm_token_type_ids" in inspect.signature(rope_index).parameters:
            extra["mm_token_type_ids"] = (ids == self.image_token_id).int()
        positions, _ = rope_index(input_ids=ids, image_grid_thw=grid, attention_mask=mask, **extra)
        return positions

    def pixel_inputs(self, images: tuple[bytes, ...] | list[bytes], where: str = "images") -> dict:
        """The model's pixel inputs (`pixel_values`, `image_grid_thw`) for compressed images, by the model's
        `VisionProcessor`; DataError naming `where` for an image that does not decode."""
        if self.vision is None:
            raise ValueError(f"{where}: the engine's model is a text model ({self.model.config.model_type})")
        return self.vision.pixel_inputs(list(images), where=where)

    def _image_features(self, prompts: list[Prompt], pixels: list[dict | None]
                        ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every image prompt's image features and patch grids, in batch order (one tensor per image); the vision
        tower runs once per distinct images tuple or pixel inputs (a prompt's samples share theirs)."""
        done: dict[int, tuple[list[torch.Tensor], torch.Tensor]] = {}
        features, grids = [], []
        for index, (prompt, given) in enumerate(zip(prompts, pixels)):
            if not isinstance(prompt, ImagePrompt):
                if self.image_token_id in prompt:
                    raise ValueError(f"prompt {index} holds the image token {self.image_token_id} but no images: "
                                     "send it as an ImagePrompt with its images")
                continue
            key = id(given) if given is not None else id(prompt.images)
            if key not in done:
                inputs = given or self.pixel_inputs(prompt.images, where=f"prompt {index}: images")
                grid = inputs["image_grid_thw"]
                _check_image_tokens(prompt.ids, grid, self.image_token_id, self.vision.merge_size, index)
                output = self.model.get_image_features(inputs["pixel_values"].to(self.device), grid.to(self.device))
                done[key] = (list(getattr(output, "pooler_output", output)), grid)  # an output, or (before 5) a tuple
            image_features, grid = done[key]
            features.extend(image_features)
            grids.append(grid)
        return features, grids

    # ---- weights ----
    def parameter_name(self, name: str) -> str:
        """The model parameter the weight `name` loads into: a Hugging Face checkpoint (file) name, renamed by
        transformers' checkpoint conversion mapping as `from_pretrained` renames it, or a parameter's own name (a
        tied alias included). KeyError naming `name` when it is none of these."""
        found = self._names.get(name)
        if found is not None:
            return found
        found = self._aliases.get(name)
        if found is None:
            found = self._aliases.get(_checkpoint_rename(self.model, name, self._aliases))
        if found is None:
            raise KeyError(f"weight {name!r} is not a parameter of the engine's model (nor a checkpoint name of one)")
        self._names[name] = found
        return found

    def update_weights(self, bucket: WeightBucket, version: int) -> None:
        if version < self.version:  # newer versions may skip numbers (a resumed run starts at its step)
            raise ValueError(f"weight version {version} is older than the served version {self.version}")
        with torch.no_grad():
            for name, tensor in bucket:
                slot = _fused_expert_slot(name, self._params)
                if slot is not None:  # one expert's projection, a piece of transformers 5's fused experts
                    target_name, expert, rows = slot
                    target = self._params[target_name][expert, rows]
                    self._pieces.setdefault(target_name, set()).add((expert, rows.start))
                else:
                    target_name = self.parameter_name(name)
                    target = self._params[target_name]
                if target.shape != tensor.shape:
                    raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} != engine's {tuple(target.shape)}")
                target.copy_(tensor.to(device=target.device, dtype=target.dtype))
                whole = slot is None or len(self._pieces[target_name]) == _fused_pieces(target_name,
                                                                                        self._params[target_name])
                if whole:
                    self._loaded.add(target_name)

    def finish_weight_update(self, version: int) -> int:
        missing = sorted(set(self._params) - self._loaded)  # tied weights appear once in _params
        self._loaded.clear()
        self._pieces.clear()
        if missing:
            raise RuntimeError(f"weight update {version} left parameters unset: {missing[:8]}")
        self.version = version
        return self.version

    def health(self) -> dict:
        return {"version": self.version, "device": str(self.device), "engine": "hf",
                "vision": self.vision is not None}


def cached_forward(model: Any, cache: Any, **inputs: Any) -> tuple[Any, Any]:
    """One forward step of `model` reusing the KV cache `cache` (None: start one); (its output, the cache to pass
    next). transformers 5 takes and returns the cache as `cache` (`past_key_values` is deprecated there, with a
    warning at every step); earlier versions as `past_key_values`."""
    if _takes_cache(type(model)):
        output = model(cache=cache, use_cache=True, **inputs)
        return output, output.cache
    output = model(past_key_values=cache, use_cache=True, **inputs)
    return output, output.past_key_values


@functools.cache
def _takes_cache(model_class: type) -> bool:
    return "cache" in inspect.signature(model_class.forward).parameters


def next_positions(positions: torch.Tensor) -> torch.Tensor:
    """The positions of the token after each row's last: one past the row's largest position so far ((B, W) ->
    (B, 1); M-RoPE's (3, B, W) -> (3, B, 1), the same on all three rows, as text tokens after an image take)."""
    if positions.dim() == 2:
        return positions[:, -1:] + 1
    following = positions.amax(dim=(0, 2)) + 1
    return following.view(1, -1, 1).expand(3, -1, 1)


def _check_image_tokens(ids: list[int], grid: torch.Tensor, image_token_id: int, merge_size: int,
                        index: int) -> None:
    """An image prompt's ids must hold one run of image tokens per image, each as long as its image's merged
    patches; ValueError naming the prompt and both counts otherwise (e.g. the ids were expanded with other
    min/max pixels than the engine's processor)."""
    runs, previous = [], None
    for token in ids:
        if token == image_token_id:
            if previous == image_token_id:
                runs[-1] += 1
            else:
                runs.append(1)
        previous = token
    expected = [int(t * h * w) // merge_size ** 2 for t, h, w in grid.tolist()]
    if runs != expected:
        raise ValueError(f"prompt {index}: its ids hold image-token runs of lengths {runs}, but its "
                         f"{len(expected)} image(s) give {expected} tokens with this engine's processor (expanded "
                         "with other min/max pixels, or a placeholder missing?)")


# one routed expert's projection in a released mixture-of-experts checkpoint (Qwen2-MoE, Qwen3-MoE)
_EXPERT_WEIGHT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _fused_expert_slot(name: str, params: dict[str, torch.Tensor]) -> tuple[str, int, slice] | None:
    """Where the per-expert checkpoint weight `name` goes in a model whose experts transformers 5 fuses
    (`experts.gate_up_proj` [experts, 2 x width, hidden], gate rows first; `experts.down_proj` [experts, hidden,
    width]): (parameter, expert, rows); None for any other weight, or a model that keeps experts apart."""
    match = _EXPERT_WEIGHT.match(name)
    if match is None:
        return None
    prefix, expert, projection = match.group(1), int(match.group(2)), match.group(3)
    fused = f"{prefix}.down_proj" if projection == "down_proj" else f"{prefix}.gate_up_proj"
    if fused not in params:
        return None
    rows = params[fused].shape[1]
    if projection == "down_proj":
        return fused, expert, slice(0, rows)
    half = rows // 2
    return (fused, expert, slice(0, half)) if projection == "gate_proj" else (fused, expert, slice(half, rows))


def _fused_pieces(name: str, param: torch.Tensor) -> int:
    """Pieces that fill the fused experts parameter `name`: gate and up of each expert, or each expert's down."""
    return param.shape[0] * (2 if name.endswith(".gate_up_proj") else 1)


def _checkpoint_rename(model: Any, name: str, parameters: dict[str, str]) -> str:
    """The parameter name `from_pretrained` gives the checkpoint tensor `name`: transformers 5's conversion
    mapping of the model's class (renamings only: a tensor that loading merges or splits is refused, naming the
    whole it must arrive as), or before transformers 5 the class's `_checkpoint_conversion_mapping` regexes."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:
        for pattern, replacement in getattr(model, "_checkpoint_conversion_mapping", {}).items():
            renamed, count = re.subn(pattern, replacement, name)
            if count:
                return renamed
        return name
    mapping = get_model_conversion_mapping(model)
    renamings = [entry for entry in mapping if isinstance(entry, WeightRenaming)]
    converters = [entry for entry in mapping if isinstance(entry, WeightConverter)]
    renamed, converter = rename_source_key(name, renamings, converters, model.base_model_prefix, parameters)
    if converter is not None:
        raise KeyError(f"weight {name!r} needs transformers' conversion {converter!r} (tensors merged or split on "
                       f"loading), which the engine does not apply: send {renamed!r} whole")
    return renamed


def _filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Softmax of temperature-scaled logits after top-k and top-p truncation."""
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < params.top_p
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return probs
