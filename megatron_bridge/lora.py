"""LoRA adapters on megatron-core's tensor-parallel linears, named and laid out as PEFT's.

Each adapted linear of a decoder layer gets one adapter module, a sibling of the linear in its attention or MLP
block (`lora_linear_qkv`, `lora_linear_proj`, `lora_linear_fc1`, `lora_linear_fc2`), holding one A [rank, in] and
one B [out, rank] per Hugging Face projection it covers: the fused `linear_qkv` covers q/k/v and `linear_fc1`
gate/up, so targeting `q_proj` adapts only the query rows of the fused weight. The linear's output becomes
`W x + scale * B A dropout(x)` with scale = alpha / rank, as PEFT computes it.

Tensor parallelism, as the weights are split:
- column-parallel (`linear_qkv`, `linear_fc1`): A replicated, B split on its output rows like the weight (q/k/v
  by query groups, gate/up each by rows); with sequence parallelism the adapter sees the all-gathered input and
  A's gradient is summed over the tensor-parallel ranks (megatron's `sequence_parallel` parameter attribute);
- row-parallel (`linear_proj`, `linear_fc2`): A split on its input columns, B replicated; the rank's partial
  A x is all-reduced (reduce-scattered over the sequence with sequence parallelism, B's gradient then summed).

The adapters save in distributed checkpoints under their own keys (B's or A's split axis declared), so they load
at any TP x PP layout. `merged_weight` gives a linear's weight shard with its adapters merged, which the bridge
exports in HF names (the engines receive plain weights); `peft_tensors` gathers the adapters into PEFT's names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ALL_LINEAR = "all-linear"
ADAPTER_PREFIX = "lora_"
# linear inside a decoder layer -> (its block, the HF projections it holds in order, layout)
LINEARS = {
    "self_attention.linear_qkv": ("self_attention", ("q_proj", "k_proj", "v_proj"), "qkv"),
    "self_attention.linear_proj": ("self_attention", ("o_proj",), "row"),
    "mlp.linear_fc1": ("mlp", ("gate_proj", "up_proj"), "gate_up"),
    "mlp.linear_fc2": ("mlp", ("down_proj",), "row"),
}


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def expand_targets(targets: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """`targets` as HF projection names in `TARGETS` order (`all-linear`: every one); ValueError naming an unknown."""
    names = set(TARGETS) if ALL_LINEAR in targets else set(targets)
    unknown = sorted(names - set(TARGETS))
    if unknown:
        raise ValueError(f"unknown LoRA targets {unknown}; choose from {list(TARGETS)} or {ALL_LINEAR}")
    return tuple(name for name in TARGETS if name in names)


def is_adapter_name(name: str) -> bool:
    """Whether a parameter / state-dict name belongs to an adapter."""
    return any(part.startswith(ADAPTER_PREFIX) for part in name.split("."))


class LinearAdapter(torch.nn.Module):
    """The adapters of one tensor-parallel linear (see the module docstring); `delta(x)` is what they add to the
    linear's output, `weight_delta()` the same as a change of the linear's weight shard."""

    def __init__(self, linear: torch.nn.Module, layout: str, projections: tuple[str, ...], spec: LoraSpec,
                 config, seed: int, layer: int):
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        super().__init__()
        self.layout, self.projections, self.spec = layout, projections, spec
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.sequence_parallel = bool(config.sequence_parallel) and self.tp > 1
        self.dropout = torch.nn.Dropout(spec.dropout) if spec.dropout > 0 else torch.nn.Identity()
        weight = linear.weight
        out_local, in_local = weight.shape
        self.column = layout != "row"
        if layout == "qkv":
            self.groups = config.num_query_groups // self.tp
            self.head_dim = config.kv_channels
            self.heads_per_group = config.num_attention_heads // config.num_query_groups
            rows = {"q_proj": self.groups * self.heads_per_group * self.head_dim,
                    "k_proj": self.groups * self.head_dim, "v_proj": self.groups * self.head_dim}
        elif layout == "gate_up":
            rows = {"gate_proj": out_local // 2, "up_proj": out_local // 2}
        else:
            rows = {projections[0]: out_local}
        self.rows = rows
        in_full = in_local if self.column else in_local * self.tp
        self.lora_A = torch.nn.ParameterDict()
        self.lora_B = torch.nn.ParameterDict()
        for name in projections:
            if name not in spec.targets:
                continue
            # PEFT's initialisation (kaiming-uniform A, zero B), drawn whole from a seed of (seed, layer, projection)
            # so every layout starts from the same adapters
            generator = torch.Generator().manual_seed(seed * 1_000_003 + layer * 101 + TARGETS.index(name))
            bound = 1.0 / math.sqrt(in_full)
            a_full = (torch.rand(spec.rank, in_full, generator=generator, dtype=torch.float64) * 2 - 1) * bound
            a = a_full if self.column else a_full[:, self.tp_rank * in_local:(self.tp_rank + 1) * in_local]
            b = torch.zeros(rows[name], spec.rank)
            self.lora_A[name] = torch.nn.Parameter(a.to(weight.dtype).to(weight.device).contiguous())
            self.lora_B[name] = torch.nn.Parameter(b.to(weight.dtype).to(weight.device))
            split, split_dim = (self.lora_B[name], 0) if self.column else (self.lora_A[name], 1)
            set_tensor_model_parallel_attributes(split, True, split_dim, 1)
            replicated = self.lora_A[name] if self.column else self.lora_B[name]
            # replicated over TP but computed from a part of the sequence: megatron sums its gradient over TP
            replicated.sequence_parallel = self.sequence_parallel

    @property
    def adapted(self) -> tuple[str, ...]:
        return tuple(self.lora_A.keys())

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """scale * B A dropout(x) for the linear's input `x`, in the layout of the linear's output shard."""
        from megatron.core.tensor_parallel import mappings

        if self.column:
            if self.sequence_parallel:
                x = mappings.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True)
            x = self.dropout(x)
            outs = {}
            for name in self.adapted:
                h = x @ self.lora_A[name].t()
                if not self.sequence_parallel:  # each rank's B shard sends back part of h's gradient
                    h = mappings.copy_to_tensor_model_parallel_region(h)
                outs[name] = h @ self.lora_B[name].t()
            return self._fused(outs, x.shape[:-1], x) * self.spec.scale
        name = self.adapted[0]
        h = self.dropout(x) @ self.lora_A[name].t()  # this rank's part of A x
        h = mappings.reduce_scatter_to_sequence_parallel_region(h) if self.sequence_parallel else \
            mappings.reduce_from_tensor_model_parallel_region(h)
        return (h @ self.lora_B[name].t()) * self.spec.scale

    def weight_delta(self) -> torch.Tensor:
        """scale * B A in fp32, laid out as the linear's weight shard [out, in]."""
        parts = {name: (self.spec.scale * (self.lora_B[name].detach().float() @ self.lora_A[name].detach().float()))
                 for name in self.adapted}
        if not self.column:
            return parts[self.adapted[0]]
        in_size = next(iter(parts.values())).shape[1]
        return self._fused({name: part.t() for name, part in parts.items()}, (in_size,), parts[self.adapted[0]]).t()

    def _fused(self, outs: dict[str, torch.Tensor], lead: tuple, like: torch.Tensor) -> torch.Tensor:
        """The per-projection outputs (last dim) placed where the fused linear has them, zeros elsewhere."""
        def part(name: str, width: int) -> torch.Tensor:
            out = outs.get(name)
            return out if out is not None else torch.zeros(*lead, width, dtype=like.dtype, device=like.device)

        if self.layout == "gate_up":
            return torch.cat([part(name, self.rows[name]) for name in self.projections], dim=-1)
        if self.layout == "qkv":
            g = self.groups
            pieces = [part(name, self.rows[name]).reshape(*lead, g, self.rows[name] // g) for name in self.projections]
            return torch.cat(pieces, dim=-1).reshape(*lead, -1)
        return outs[self.projections[0]]

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """The adapters as distributed-checkpoint tensors: B split on rows (column-parallel), A on columns
        (row-parallel), the other replicated."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        axis = {f"lora_B.{n}": 0 for n in self.adapted} if self.column else {f"lora_A.{n}": 1 for n in self.adapted}
        return make_sharded_tensors_for_checkpoint(state, prefix, axis, sharded_offsets)


def _add_delta(adapter: LinearAdapter):
    def hook(module, args, output):
        out, bias = output
        return out + adapter.delta(args[0]).to(out.dtype), bias
    return hook


def attach_adapters(model: torch.nn.Module, spec: LoraSpec, seed: int) -> int:
    """Freeze every parameter of `model` (a GPTModel chunk) and add trainable adapters on the linears `spec`
    targets in each of its decoder layers; the count of adapted linears. Mixture-of-experts MLPs are refused."""
    model.requires_grad_(False)
    count = 0
    for layer in model.decoder.layers:
        for path, (block_name, projections, layout) in LINEARS.items():
            if not set(projections) & set(spec.targets):
                continue
            block = getattr(layer, block_name)
            linear_name = path.split(".")[1]
            linear = getattr(block, linear_name, None)
            if linear is None:
                raise ValueError(f"LoRA targets {sorted(set(projections) & set(spec.targets))}: layer "
                                 f"{layer.layer_number - 1}'s {block_name} has no {linear_name} (a mixture-of-"
                                 "experts MLP); target q_proj, k_proj, v_proj, o_proj only")
            if hasattr(linear, "layer_norm_weight"):
                raise ValueError("LoRA adapts the local and torch layer specs' linears, not Transformer Engine's "
                                 "fused norm + linear: use model.attention=torch")
            adapter = LinearAdapter(linear, layout, projections, spec, layer.config, seed, layer.layer_number - 1)
            block.add_module(ADAPTER_PREFIX + linear_name, adapter)
            linear.register_forward_hook(_add_delta(adapter))
            count += 1
    return count


def adapters_by_weight(model: torch.nn.Module) -> dict[str, LinearAdapter]:
    """The adapters of `model` by the local-spec name of the weight they adapt, with global layer index
    ("decoder.layers.<i>.self_attention.linear_qkv.weight")."""
    found = {}
    for layer in model.decoder.layers:
        for path, (block_name, _, _) in LINEARS.items():
            adapter = getattr(getattr(layer, block_name), ADAPTER_PREFIX + path.split(".")[1], None)
            if adapter is not None:
                found[f"decoder.layers.{layer.layer_number - 1}.{path}.weight"] = adapter
    return found


def merged_weight(weight: torch.Tensor, adapter: LinearAdapter | None) -> torch.Tensor:
    """The weight shard with its adapters merged (computed in fp32, cast back to the weight's dtype)."""
    if adapter is None:
        return weight
    return (weight.float() + adapter.weight_delta()).to(weight.dtype)


def peft_tensors(models: list, weight_hf_names: dict[str, tuple[str, ...]], value=None) -> dict[str, torch.Tensor]:
    """Every adapter of the model, whole (gathered over TP, then over PP), in PEFT's names
    ("base_model.model.<HF module>.lora_A.weight"), as CPU tensors on every rank; `value(param)` picks what is
    gathered (default the parameter; e.g. its `main_grad`). `weight_hf_names`: megatron weight name -> its HF
    weight names (the bridge's table). Every rank of the model-parallel group calls it."""
    from megatron.core import parallel_state

    value = value or (lambda param: param.detach())
    mine: dict[str, torch.Tensor] = {}
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    for model in models:
        model = getattr(model, "module", model)
        while hasattr(model, "module"):
            model = model.module
        for weight_name, adapter in adapters_by_weight(model).items():
            hf_names = dict(zip(adapter.projections, weight_hf_names[weight_name]))
            for name in adapter.adapted:
                for kind, param in (("lora_A", adapter.lora_A[name]), ("lora_B", adapter.lora_B[name])):
                    tensor = value(param).float().contiguous()
                    split = getattr(param, "tensor_model_parallel", False)
                    if split and tp > 1:
                        parts = [torch.empty_like(tensor) for _ in range(tp)]
                        dist.all_gather(parts, tensor, group=tp_group)
                        tensor = torch.cat(parts, dim=param.partition_dim)
                    module = hf_names[name].removesuffix(".weight")
                    mine[f"base_model.model.{module}.{kind}.weight"] = tensor.cpu()
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        held = [None] * parallel_state.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(held, mine, group=parallel_state.get_pipeline_model_parallel_group())
        mine = {name: tensor for part in held for name, tensor in part.items()}
    return dict(sorted(mine.items()))


def write_peft_dir(out_dir: str, tensors: dict[str, torch.Tensor], spec: LoraSpec, base_model: str) -> None:
    """A PEFT adapter directory: adapter_model.safetensors (`peft_tensors`) and adapter_config.json."""
    import json
    import os

    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(peft_config(spec, base_model), f, indent=2)


def peft_config(spec: LoraSpec, base_model: str) -> dict:
    """PEFT's adapter_config.json for `spec` over the model at `base_model`."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
            "target_modules": list(spec.targets), "bias": "none", "fan_in_fan_out": False,
            "inference_mode": True, "init_lora_weights": True, "use_rslora": False, "use_dora": False,
            "modules_to_save": None}
