"""`Bridge`: build megatron-core models from Hugging Face checkpoints and stream weights back in HF names.

Any TP x PP (x EP for a mixture of experts) layout: each rank builds its pipeline stage's chunk, reads only
its tensor-parallel slices (and its experts) from the safetensors files, and on export every rank yields the
whole model in HF names and order, gathered over TP (all-gather), EP (broadcast from the rank holding each
expert) and PP (broadcast from the stage that holds each layer). Every rank of a
model-parallel group must take part in `export_hf_weights` / `save_hf_pretrained` (they are collectives).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from megatron_bridge import vision
from megatron_bridge.arch import Architecture, get_architecture
from megatron_bridge.arch.base import split_gate_up, split_qkv
from megatron_bridge.config_map import (
    check_supported,
    head_dim,
    num_experts,
    num_query_groups,
    to_hf_config,
    to_megatron,
)
from megatron_bridge.layer_spec import layer_spec, resolve_attention, to_local_name
from megatron_bridge.lora import adapters_by_weight, is_adapter_name, merged_weight
from megatron_bridge.safetensors_io import INDEX_FILE, SINGLE_FILE, SafetensorsReader
from megatron_bridge.sharding import VOCAB_PARAMS, ExpertShard, TPSlice, expert_index, gather_full, load_into
from megatron_bridge.vl_model import vision_language_model_class

# files copied beside the saved weights so tokenizer, chat template and generation defaults come along
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "added_tokens.json", "preprocessor_config.json", "processor_config.json")

Bucket = list[tuple[str, torch.Tensor]]
Row = tuple[str, tuple[str, ...], str]


class Bridge:
    """One HF model directory and its architecture table: HF <-> megatron weights for this rank."""

    def weight_hf_names(self) -> dict[str, tuple[str, ...]]:
        """Megatron (local-spec) parameter name -> the HF tensor names it holds, for every row of the table."""
        return {mcore: hf_names for mcore, hf_names, _ in self._all_rows()}

    def __init__(self, hf_dir: str | Path, hf_config: dict[str, Any], vocab_divisible_by: int = 128):
        self.hf_dir = Path(hf_dir)
        self.hf_config = hf_config
        self.arch: Architecture = get_architecture(hf_config)
        # the language model's fields (a vision-language config nests them, see `megatron_bridge.vision`)
        self.lm_config = vision.language_config(hf_config) if self.arch.vision else hf_config
        self.vocab_divisible_by = vocab_divisible_by
        self._vision_rows: list[Row] | None = None
        check_supported(self.lm_config)

    @classmethod
    def from_hf_pretrained(cls, hf_dir: str | Path, vocab_divisible_by: int = 128) -> Bridge:
        """A bridge for the HF model in `hf_dir` (its config.json is read now, its weights when loading)."""
        path = Path(hf_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: not a Hugging Face model directory")
        return cls(hf_dir, json.loads(path.read_text()), vocab_divisible_by)

    @property
    def vocab_size(self) -> int:
        """The real vocabulary: megatron's logits past it (padding rows) are not part of the model."""
        return int(self.lm_config["vocab_size"])

    @property
    def num_experts(self) -> int:
        """Routed experts per layer (0 for a dense model)."""
        return num_experts(self.lm_config) if self.arch.moe else 0

    @property
    def tied_embeddings(self) -> bool:
        return bool(self.lm_config.get("tie_word_embeddings"))

    @property
    def image_token_id(self) -> int | None:
        """The token whose places the vision tower's embeddings take (None for a text-only model)."""
        return vision.image_token_id(self.hf_config) if self.arch.vision else None

    # ---- Hugging Face -> megatron --------------------------------------------------------------------

    def to_megatron_model(self, load_weights: bool = True, params_dtype: torch.dtype = torch.float32,
                          training: dict | None = None, attention: str = "auto") -> list:
        """This rank's GPTModel chunks, built inside initialised megatron parallel state for its TP x PP position:
        one, or with virtual pipeline stages one per stage (chunk v holds the v-th of this rank's interleaved layer
        ranges), with the HF weights loaded when `load_weights` (a vision-language checkpoint gives a
        `VisionLanguageModel`, its vision tower on the first stage); `training`: TransformerConfig fields such as
        activation recomputation (see `to_megatron`); `attention`: the layer spec, "auto", "te", "torch" or
        "local" (see `megatron_bridge.layer_spec`)."""
        from megatron.core import parallel_state

        attention = resolve_attention(attention)
        virtual = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
        if virtual > 1 and self.arch.vision:
            raise ValueError(f"{self.arch.name}: virtual pipeline stages are not built for vision-language models "
                             f"(actor.parallel.virtual_pipeline={virtual}; use 1)")
        if self.num_experts:
            _define_te_general_gemm()
        config, kwargs = to_megatron(self.lm_config, self.arch, params_dtype,
                                     parallel_state.get_tensor_model_parallel_world_size(),
                                     parallel_state.get_pipeline_model_parallel_world_size(),
                                     self.vocab_divisible_by, training,
                                     parallel_state.get_context_parallel_world_size(), virtual_pipeline=virtual,
                                     expert_parallel=parallel_state.get_expert_model_parallel_world_size())
        if attention == "local" and config.context_parallel_size > 1:
            raise ValueError("context parallelism needs attention 'torch' or 'te' (megatron's local attention "
                             "refuses it)")
        spec = layer_spec(attention, self.arch.qk_layernorm, self.num_experts)
        chunks = [self._build_chunk(config, kwargs, spec, params_dtype, vp_stage if virtual > 1 else None)
                  for vp_stage in range(virtual)]
        if load_weights:
            self.load_hf_weights(chunks)
        return chunks

    def _build_chunk(self, config, kwargs: dict, spec: tuple, params_dtype: torch.dtype, vp_stage: int | None):
        """One GPTModel chunk of this rank (`spec`: the layer spec and final norm, `vp_stage`: its virtual pipeline
        stage, None without them)."""
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

        from megatron_bridge.rotary import rotates_per_token, token_rotary_gpt_model_class

        layer, final_norm = spec
        block = TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config, vp_stage),
                                           layer_norm=final_norm)
        first = parallel_state.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
        if self.arch.vision:
            model = vision_language_model_class()(
                config, block, pre_process=first, post_process=last,
                mrope_section=vision.mrope_section(self.hf_config),
                image_token_id=self.image_token_id,
                vision_tower=vision.build_vision_tower(self.hf_config, params_dtype) if first else None, **kwargs)
        else:  # the torch and local specs rotate packed rows with per-token angles, which the model then gives
            model_class = token_rotary_gpt_model_class(GPTModel) if rotates_per_token(layer) else GPTModel
            model = model_class(config, block, pre_process=first, post_process=last, vp_stage=vp_stage, **kwargs)
        model = model.to(params_dtype)  # modules that ignore params_dtype (the torch RMSNorm fallback) too, as
        if torch.cuda.is_available():    # megatron's Float16Module does: the optimizer keeps the fp32 copies
            model = model.cuda()
        return model

    def load_hf_weights(self, models: list) -> None:
        """Copy the HF safetensors weights into this rank's `models`, reading only this rank's slices."""
        params = self._rank_parameters(models)
        with SafetensorsReader(self.hf_dir) as reader:  # (leaving it waits for copies still on their way)
            self._check_checkpoint_names(reader.names())
            for mcore, hf_names, layout in self._load_rows(params):
                target = params[mcore]
                where = TPSlice.current(mcore, target)
                try:
                    load_into(reader, hf_names, layout, where, num_query_groups(self.lm_config), target.data)
                except ValueError as error:
                    raise ValueError(f"{hf_names} -> {mcore}: {error}") from error

    # ---- megatron -> Hugging Face --------------------------------------------------------------------

    def export_hf_weights(self, models: list, bucket_bytes: int = 256 << 20) -> Iterator[Bucket]:
        """Buckets of `(hf_name, tensor)` in HF names, layout and order, covering every tensor of the HF
        checkpoint once, identical on every rank and for every TP x PP layout. A bucket holds at most
        `bucket_bytes`, unless a single tensor is larger (a bucket of one). Tensors are contiguous CPU
        copies that share no storage with the model."""
        bucket: Bucket = []
        size = 0
        for name, tensor in self._iter_hf_tensors(models):
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > bucket_bytes:
                yield _finished(bucket)
                bucket, size = [], 0
            bucket.append((name, _owned_cpu_copy(tensor)))
            size += nbytes
        if bucket:
            yield _finished(bucket)

    def save_hf_pretrained(self, models: list, out_dir: str | Path, max_shard_bytes: int = 5 << 30) -> None:
        """Write config.json, the weights (one model.safetensors, or shards of at most `max_shard_bytes`
        with an index) and the source's tokenizer files, loadable by transformers' `from_pretrained`.
        Call it on every rank; global rank 0 writes."""
        writer = not dist.is_initialized() or dist.get_rank() == 0
        out = Path(out_dir)
        if writer:
            out.mkdir(parents=True, exist_ok=True)
            for stale in [*out.glob("model-*-of-*.safetensors"), out / SINGLE_FILE, out / INDEX_FILE]:
                stale.unlink(missing_ok=True)
        shards: list[list[str]] = []
        dtype, total = None, 0
        for bucket in self.export_hf_weights(models, bucket_bytes=max_shard_bytes):
            if not writer:
                continue
            dtype = bucket[0][1].dtype if dtype is None else dtype
            total += sum(tensor.numel() * tensor.element_size() for _, tensor in bucket)
            save_file(dict(bucket), str(out / f"shard-{len(shards)}.tmp"), metadata={"format": "pt"})
            shards.append([name for name, _ in bucket])
        if not writer:
            return
        if len(shards) == 1:
            (out / "shard-0.tmp").rename(out / SINGLE_FILE)
        else:
            weight_map = {}
            for k, names in enumerate(shards):
                final = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
                (out / f"shard-{k}.tmp").rename(out / final)
                weight_map.update({name: final for name in names})
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        config = to_hf_config(self.hf_config, _unwrap(models[0]), dtype, self.vocab_divisible_by)
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if self.hf_dir.resolve() != out.resolve():
            for name in TOKENIZER_FILES:
                if (self.hf_dir / name).is_file():
                    shutil.copy2(self.hf_dir / name, out / name)

    def _iter_hf_tensors(self, models: list) -> Iterator[tuple[str, torch.Tensor]]:
        """Every HF tensor in table order: gathered over TP by its stage (a routed expert over expert TP by
        its EP rank, then broadcast to the stage's other EP ranks), broadcast over PP."""
        from megatron.core import parallel_state

        params = self._rank_parameters(models)
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        pp_ranks = dist.get_process_group_ranks(pp_group) if dist.is_initialized() else [0]
        owners = self._stage_owners(params, pp_group, len(pp_ranks))
        adapters = {name: adapter for model in models for name, adapter in adapters_by_weight(_unwrap(model)).items()}
        my_stage = parallel_state.get_pipeline_model_parallel_rank()
        shard = ExpertShard.current(self.num_experts)
        ep_group = parallel_state.get_expert_model_parallel_group() if shard.size > 1 else None
        ep_ranks = dist.get_process_group_ranks(ep_group) if ep_group is not None else [0]
        for mcore, hf_names, layout in self._all_rows():
            tensors = None
            expert = expert_index(mcore)
            stage = owners[mcore if expert is None else _router_of(mcore)]
            if stage == my_stage and mcore in params:
                param = params[mcore]  # (detach() would drop megatron's partition attributes)
                local = merged_weight(param.detach(), adapters.get(mcore))  # LoRA adapters merged in
                full = gather_full(local, layout, TPSlice.current(mcore, param))
                if mcore in VOCAB_PARAMS:
                    full = full[:self.vocab_size]
                tensors = self._split(full, layout)
            if expert is not None and shard.size > 1 and stage == my_stage:
                tensors = _broadcast_tensors(tensors, ep_ranks[shard.owner(expert)], ep_group,
                                             known=self._expert_meta(mcore, layout, params, shard))
            if len(pp_ranks) > 1:
                tensors = _broadcast_tensors(tensors, pp_ranks[stage], pp_group)
            yield from zip(hf_names, tensors)

    def _expert_meta(self, mcore: str, layout: str, params: dict[str, torch.Tensor], shard: ExpertShard) -> Meta:
        """Shapes and dtypes of the HF tensors of expert row `mcore`: those of this rank's own first expert in
        the same place (every expert alike), so the EP broadcast needs no metadata round."""
        own = shard.global_name(mcore.replace(f".local_experts.{expert_index(mcore)}.", ".local_experts.0.", 1))
        param = params[own]
        where = TPSlice.current(own, param)
        shape = list(param.shape)
        if where.dim is not None:
            shape[where.dim] *= where.size
        if layout == "gate_up":
            return [((shape[0] // 2, *shape[1:]), param.dtype)] * 2
        return [(tuple(shape), param.dtype)]

    # ---- rows of the table on this rank --------------------------------------------------------------

    def _all_rows(self) -> list[Row]:
        rows = self.arch.rows(self.lm_config["num_hidden_layers"], self.tied_embeddings, self.num_experts)
        if self.arch.vision:
            if self._vision_rows is None:
                self._vision_rows = [(vision.MEGATRON_PREFIX + name, (vision.HF_PREFIX + name,), "same")
                                     for name in vision.vision_parameter_names(self.hf_config)]
            rows = self._vision_rows + rows
        return rows

    def _rank_parameters(self, models: list) -> dict[str, torch.Tensor]:
        """This rank's parameters by megatron name (in the local spec's names, as the tables are written; see
        `megatron_bridge.layer_spec`) with global layer (and expert) indices, checked against the table: every
        row of this stage's layers (its experts only, for a mixture of experts) and its embedding / final norm /
        output layer is present and nothing else, except the output layer that a last stage holds as a copy of
        tied embeddings."""
        shard = ExpertShard.current(self.num_experts)
        params, layers = {}, set()
        first = last = False
        for model in models:
            model = _unwrap(model)
            first, last = first or model.pre_process, last or model.post_process
            global_index = {str(j): layer.layer_number - 1 for j, layer in enumerate(model.decoder.layers)}
            layers.update(global_index.values())
            for name, param in model.named_parameters():
                if is_adapter_name(name):  # LoRA adapters: merged into their linears' weights on export
                    continue
                parts = name.split(".")
                if name.startswith("decoder.layers."):
                    parts[2] = str(global_index[parts[2]])
                params[to_local_name(shard.global_name(".".join(parts)))] = param  # the tables' names
        expected = {mcore for mcore, _, _ in self._all_rows()
                    if _row_on_stage(mcore, layers, first, last) and shard.holds(mcore)}
        tied_copy = {"output_layer.weight"} if self.tied_embeddings and last and not first else set()
        missing, unmapped = sorted(expected - set(params)), sorted(set(params) - expected - tied_copy)
        if missing or unmapped:
            raise KeyError(f"{self.arch.name} table and megatron model disagree: not in the model {missing}, "
                           f"not in the table {unmapped} (local-spec names; a TE-spec model's are translated, "
                           "see megatron_bridge.layer_spec)")
        return params

    def _load_rows(self, params: dict[str, torch.Tensor]) -> list[Row]:
        rows = [row for row in self._all_rows() if row[0] in params]
        if self.tied_embeddings and "output_layer.weight" in params:  # last stage's copy of the embedding
            rows.append(("output_layer.weight", ("model.embed_tokens.weight",), "same"))
        return rows

    def _stage_owners(self, params: dict[str, torch.Tensor], pp_group, pp_size: int) -> dict[str, int]:
        """Pipeline stage that holds each row's parameter (the first stage for tied embeddings)."""
        mine = sorted(name for name in params if not (name == "output_layer.weight" and self.tied_embeddings))
        if pp_size == 1:
            return dict.fromkeys(mine, 0)
        held: list[list[str] | None] = [None] * pp_size
        dist.all_gather_object(held, mine, group=pp_group)
        return {name: stage for stage, names in enumerate(held) for name in names}

    def _check_checkpoint_names(self, names: list[str]) -> None:
        mapped = {hf for _, hf_names, _ in self._all_rows() for hf in hf_names}
        unexpected = sorted(name for name in set(names) - mapped if not self._ignorable(name))
        absent = sorted(mapped - set(names))
        if unexpected or absent:
            raise ValueError(f"{self.hf_dir}: checkpoint and the {self.arch.name} table disagree: "
                             f"tensors the table does not map {_first(unexpected)}, "
                             f"tensors the table needs but the checkpoint lacks {_first(absent)}")

    def _ignorable(self, hf_name: str) -> bool:
        return (hf_name == "lm_head.weight" and self.tied_embeddings) or hf_name.endswith(self.arch.ignored_hf_suffixes)

    def _split(self, tensor: torch.Tensor, layout: str) -> tuple[torch.Tensor, ...]:
        if layout == "same":
            return (tensor,)
        if layout == "qkv":
            groups = num_query_groups(self.lm_config)
            return split_qkv(tensor, groups, self.lm_config["num_attention_heads"] // groups, head_dim(self.lm_config))
        if layout == "gate_up":
            return split_gate_up(tensor)
        raise ValueError(f"unknown layout {layout!r}")


def _row_on_stage(mcore: str, layers: set[int], first: bool, last: bool) -> bool:
    if mcore.startswith("decoder.layers."):
        return int(mcore.split(".")[2]) in layers
    return first if mcore.startswith(("embedding.", vision.MEGATRON_PREFIX)) else last


def _define_te_general_gemm() -> None:
    """megatron-core 0.16.1's router tests `te_general_gemm is not None` but, without Transformer Engine, never
    defines the name (a NameError at the first forward): define it as None, which selects its torch matmul."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _router_of(expert_param: str) -> str:
    """The router of an expert's layer: every EP rank of the layer's stage holds it (see `_stage_owners`)."""
    return expert_param.split(".mlp.experts.")[0] + ".mlp.router.weight"


Meta = list[tuple[tuple[int, ...], torch.dtype]]


def _broadcast_tensors(tensors: tuple[torch.Tensor, ...] | None, src: int, group,
                       known: Meta | None = None) -> tuple[torch.Tensor, ...]:
    """`tensors` of the rank `src` (global rank) on every rank of `group`: shapes and dtypes first, unless every
    rank `known`s them already."""
    meta = [known]
    if known is None:
        meta = [[(tuple(t.shape), t.dtype) for t in tensors] if tensors is not None else None]
        dist.broadcast_object_list(meta, src=src, group=group)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if tensors is None:
        tensors = tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in meta[0])
    else:
        tensors = tuple(t.contiguous() for t in tensors)
    for tensor in tensors:
        dist.broadcast(tensor, src=src, group=group)
    return tensors


def _first(names: list[str], count: int = 8) -> str:
    return f"{names[:count]}" + (f" and {len(names) - count} more" if len(names) > count else "")


def _unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def _owned_cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor with its own storage (safe to hand to another process). From a GPU the
    copy goes to pinned memory without waiting; `_finished` waits once per bucket."""
    if tensor.device.type == "cpu":
        return tensor.clone(memory_format=torch.contiguous_format)
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


def _finished(bucket: Bucket) -> Bucket:
    """`bucket` once its device-to-host copies have landed."""
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()
    return bucket
