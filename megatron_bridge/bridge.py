"""`Bridge`: build megatron-core models from Hugging Face checkpoints and stream weights back in HF names."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_bridge.arch import Architecture, get_architecture
from megatron_bridge.arch.base import fuse_gate_up, fuse_qkv, split_gate_up, split_qkv
from megatron_bridge.config_map import check_supported, head_dim, num_query_groups, to_hf_config, to_megatron

# files copied beside the saved weights so tokenizer, chat template and generation defaults come along
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "added_tokens.json", "preprocessor_config.json", "processor_config.json")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

Bucket = list[tuple[str, torch.Tensor]]


class Bridge:
    """One HF model directory and its architecture table: HF <-> megatron weights for this rank."""

    def __init__(self, hf_dir: str | Path, hf_config: dict[str, Any]):
        self.hf_dir = Path(hf_dir)
        self.hf_config = hf_config
        self.arch: Architecture = get_architecture(hf_config)
        check_supported(hf_config)

    @classmethod
    def from_hf_pretrained(cls, hf_dir: str | Path) -> Bridge:
        """A bridge for the HF model in `hf_dir` (its config.json is read now, its weights when loading)."""
        path = Path(hf_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: not a Hugging Face model directory")
        return cls(hf_dir, json.loads(path.read_text()))

    # ---- Hugging Face -> megatron --------------------------------------------------------------------

    def to_megatron_model(self, load_weights: bool = True, params_dtype: torch.dtype = torch.float32) -> list:
        """This rank's GPTModel chunks (one at PP=1), built inside initialised megatron parallel state,
        with the HF weights loaded when `load_weights`."""
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        sizes = (parallel_state.get_tensor_model_parallel_world_size(),
                 parallel_state.get_pipeline_model_parallel_world_size())
        if sizes != (1, 1):
            raise NotImplementedError(f"the bridge builds TP=1 x PP=1 models only, not TP x PP = {sizes}")
        config, kwargs = to_megatron(self.hf_config, self.arch, params_dtype)
        spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=self.arch.qk_layernorm)
        model = GPTModel(config, spec, pre_process=True, post_process=True, **kwargs)
        if torch.cuda.is_available():
            model = model.cuda()
        if load_weights:
            self.load_hf_weights([model])
        return [model]

    def load_hf_weights(self, models: list) -> None:
        """Copy the HF safetensors weights into this rank's `models`, reading each tensor by slice."""
        params = _named_parameters(models)
        rows = self._rows(params)
        with _SafetensorsReader(self.hf_dir) as reader:
            used = set()
            for mcore, hf_names, layout in rows:
                fused = self._fuse([reader.read(name) for name in hf_names], layout)
                target = params[mcore]
                if fused.shape != target.shape:
                    raise ValueError(f"{hf_names} -> {mcore}: shape {tuple(fused.shape)} != {tuple(target.shape)}")
                with torch.no_grad():
                    target.copy_(fused)
                used.update(hf_names)
            unexpected = sorted(name for name in set(reader.names()) - used if not self._ignorable(name))
        if unexpected:
            raise ValueError(f"{self.hf_dir}: tensors the {self.arch.name} table does not map: {unexpected[:8]}"
                             + (f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else ""))

    # ---- megatron -> Hugging Face --------------------------------------------------------------------

    def export_hf_weights(self, models: list, bucket_bytes: int = 256 << 20) -> Iterator[Bucket]:
        """Buckets of `(hf_name, tensor)` in HF names and layout, covering every tensor of the HF checkpoint
        once. A bucket holds at most `bucket_bytes`, unless a single tensor is larger (a bucket of one).
        Tensors are contiguous CPU copies that share no storage with the model."""
        params = _named_parameters(models)
        bucket: Bucket = []
        size = 0
        for mcore, hf_names, layout in self._rows(params):
            for name, piece in zip(hf_names, self._split(params[mcore].detach(), layout)):
                tensor = _owned_cpu_copy(piece)
                nbytes = tensor.numel() * tensor.element_size()
                if bucket and size + nbytes > bucket_bytes:
                    yield bucket
                    bucket, size = [], 0
                bucket.append((name, tensor))
                size += nbytes
        if bucket:
            yield bucket

    def save_hf_pretrained(self, models: list, out_dir: str | Path, max_shard_bytes: int = 5 << 30) -> None:
        """Write config.json, the weights (one model.safetensors, or shards of at most `max_shard_bytes`
        with an index) and the source's tokenizer files, loadable by transformers' `from_pretrained`."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        for stale in [*out.glob("model-*-of-*.safetensors"), out / SINGLE_FILE, out / INDEX_FILE]:
            stale.unlink(missing_ok=True)
        shards: list[list[str]] = []
        dtype, total = None, 0
        for bucket in self.export_hf_weights(models, bucket_bytes=max_shard_bytes):
            dtype = bucket[0][1].dtype if dtype is None else dtype
            total += sum(tensor.numel() * tensor.element_size() for _, tensor in bucket)
            save_file(dict(bucket), str(out / f"shard-{len(shards)}.tmp"), metadata={"format": "pt"})
            shards.append([name for name, _ in bucket])
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
        config = to_hf_config(self.hf_config, _unwrap(models[0]), dtype)
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if self.hf_dir.resolve() != out.resolve():
            for name in TOKENIZER_FILES:
                if (self.hf_dir / name).is_file():
                    shutil.copy2(self.hf_dir / name, out / name)

    # ---- layouts --------------------------------------------------------------------------------------

    def _rows(self, params: dict[str, torch.Tensor]) -> list[tuple[str, tuple[str, ...], str]]:
        """The table's rows for this model, checked against the megatron parameters both ways."""
        rows = self.arch.rows(self.hf_config["num_hidden_layers"], bool(self.hf_config.get("tie_word_embeddings")))
        mapped = {mcore for mcore, _, _ in rows}
        missing, unmapped = sorted(mapped - set(params)), sorted(set(params) - mapped)
        if missing or unmapped:
            raise KeyError(f"{self.arch.name} table and megatron model disagree: not in the model {missing}, "
                           f"not in the table {unmapped}")
        return rows

    def _ignorable(self, hf_name: str) -> bool:
        tied_head = hf_name == "lm_head.weight" and bool(self.hf_config.get("tie_word_embeddings"))
        return tied_head or hf_name.endswith(self.arch.ignored_hf_suffixes)

    def _groups(self) -> tuple[int, int, int]:
        groups = num_query_groups(self.hf_config)
        return groups, self.hf_config["num_attention_heads"] // groups, head_dim(self.hf_config)

    def _fuse(self, tensors: list[torch.Tensor], layout: str) -> torch.Tensor:
        if layout == "same":
            return tensors[0]
        if layout == "qkv":
            return fuse_qkv(*tensors, num_query_groups=self._groups()[0])
        if layout == "gate_up":
            return fuse_gate_up(*tensors)
        raise ValueError(f"unknown layout {layout!r}")

    def _split(self, tensor: torch.Tensor, layout: str) -> tuple[torch.Tensor, ...]:
        if layout == "same":
            return (tensor,)
        if layout == "qkv":
            return split_qkv(tensor, *self._groups())
        if layout == "gate_up":
            return split_gate_up(tensor)
        raise ValueError(f"unknown layout {layout!r}")


def _unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def _named_parameters(models: list) -> dict[str, torch.Tensor]:
    """Parameters of this rank's (unwrapped) model chunks by megatron name."""
    named = {}
    for model in models:
        named.update(dict(_unwrap(model).named_parameters()))
    return named


def _owned_cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor with its own storage (safe to hand to another process)."""
    if tensor.device.type == "cpu":
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor.contiguous().to("cpu")


class _SafetensorsReader:
    """Reads tensors, or slices of them, by name from a single or sharded (index.json) safetensors checkpoint."""

    def __init__(self, hf_dir: Path):
        if (hf_dir / INDEX_FILE).is_file():
            weight_map = json.loads((hf_dir / INDEX_FILE).read_text())["weight_map"]
            self.files = {name: hf_dir / file for name, file in weight_map.items()}
        elif (hf_dir / SINGLE_FILE).is_file():
            with safe_open(str(hf_dir / SINGLE_FILE), framework="pt") as handle:
                self.files = {name: hf_dir / SINGLE_FILE for name in handle.keys()}
        else:
            raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {hf_dir}")
        self._open: dict[Path, Any] = {}

    def names(self) -> list[str]:
        return list(self.files)

    def read(self, name: str, index: tuple[slice, ...] | slice = slice(None)) -> torch.Tensor:
        """`name[index]`, reading only that part of the file (a rank's shard, later)."""
        if name not in self.files:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        path = self.files[name]
        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="pt").__enter__()
        return self._open[path].get_slice(name)[index]

    def __enter__(self) -> _SafetensorsReader:
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._open.values():
            handle.__exit__(None, None, None)
        self._open.clear()
