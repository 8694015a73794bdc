"""`Bridge`: build megatron-core models from Hugging Face checkpoints and stream weights back in HF names."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_bridge.arch import Architecture, get_architecture
from megatron_bridge.arch.base import fuse_gate_up, fuse_qkv, split_gate_up, split_qkv
from megatron_bridge.config_map import check_supported, head_dim, to_megatron

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")

Bucket = list[tuple[str, torch.Tensor]]


class Bridge:
    def __init__(self, hf_dir: str | Path, hf_config: dict):
        self.hf_dir = Path(hf_dir)
        self.hf_config = hf_config
        self.arch: Architecture = get_architecture(hf_config.get("architectures"))
        check_supported(hf_config)

    @classmethod
    def from_hf_pretrained(cls, hf_dir: str | Path) -> Bridge:
        path = Path(hf_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: not a Hugging Face model directory")
        return cls(hf_dir, json.loads(path.read_text()))

    # ---- Hugging Face -> megatron --------------------------------------------------------------------

    def to_megatron_model(self, load_weights: bool = True, params_dtype: torch.dtype = torch.float32) -> list:
        """This rank's model chunks (inside initialised megatron parallel state), weights loaded from HF."""
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        if parallel_state.get_tensor_model_parallel_world_size() > 1 or \
                parallel_state.get_pipeline_model_parallel_world_size() > 1:
            raise NotImplementedError("the bridge builds TP=1 x PP=1 models only (TP/PP resharding: not yet)")
        config, kwargs = to_megatron(self.hf_config, self.arch, params_dtype)
        spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=self.arch.qk_layernorm)
        model = GPTModel(config, spec, pre_process=True, post_process=True, **kwargs)
        if torch.cuda.is_available():
            model = model.cuda()
        if load_weights:
            self.load_hf_weights([model])
        return [model]

    def load_hf_weights(self, models: list) -> None:
        """Copy the HF safetensors weights into `models`, reading tensor by tensor (slice reads)."""
        params = _named_tensors(models)
        with _SafetensorsReader(self.hf_dir) as reader:
            for mcore, hf_names, layout in self._rows():
                if mcore not in params:
                    raise KeyError(f"megatron model has no parameter {mcore!r} (architecture {self.arch.name})")
                tensors = [reader.read(name) for name in hf_names]
                fused = self._fuse(tensors, layout)
                target = params[mcore]
                if fused.shape != target.shape:
                    raise ValueError(f"{hf_names} -> {mcore}: shape {tuple(fused.shape)} != {tuple(target.shape)}")
                with torch.no_grad():
                    target.copy_(fused.to(dtype=target.dtype, device=target.device))

    # ---- megatron -> Hugging Face --------------------------------------------------------------------

    def export_hf_weights(self, models: list, bucket_bytes: int = 256 << 20) -> Iterator[Bucket]:
        """Buckets of `(hf_name, tensor)` in HF layout; each at most `bucket_bytes` unless one tensor is larger."""
        params = _named_tensors(models)
        bucket: Bucket = []
        size = 0
        for mcore, hf_names, layout in self._rows():
            for name, tensor in zip(hf_names, self._split(params[mcore].detach(), layout)):
                tensor = tensor.to("cpu", copy=True).contiguous()
                nbytes = tensor.numel() * tensor.element_size()
                if bucket and size + nbytes > bucket_bytes:
                    yield bucket
                    bucket, size = [], 0
                bucket.append((name, tensor))
                size += nbytes
        if bucket:
            yield bucket

    def save_hf_pretrained(self, models: list, out_dir: str | Path) -> None:
        """config.json, model.safetensors and the tokenizer files, loadable by `from_pretrained`."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        state = {name: tensor for bucket in self.export_hf_weights(models) for name, tensor in bucket}
        dtype = next(iter(state.values())).dtype
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        config = dict(self.hf_config, torch_dtype=str(dtype).removeprefix("torch."))
        config.pop("dtype", None)
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name in TOKENIZER_FILES:
            if (self.hf_dir / name).is_file() and self.hf_dir.resolve() != out.resolve():
                shutil.copy2(self.hf_dir / name, out / name)

    # ---- layouts --------------------------------------------------------------------------------------

    def _rows(self):
        return self.arch.rows(self.hf_config["num_hidden_layers"], bool(self.hf_config.get("tie_word_embeddings")))

    def _groups(self) -> tuple[int, int, int]:
        heads = self.hf_config["num_attention_heads"]
        groups = self.hf_config.get("num_key_value_heads", heads)
        return groups, heads // groups, head_dim(self.hf_config)

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


def _named_tensors(models: list) -> dict[str, torch.Tensor]:
    """Parameters of the (unwrapped) model chunks by megatron name."""
    named = {}
    for model in models:
        model = getattr(model, "module", model)
        named.update(dict(model.named_parameters()))
    return named


class _SafetensorsReader:
    """Reads tensors by name from a single or sharded (index.json) safetensors checkpoint."""

    def __init__(self, hf_dir: Path):
        index = hf_dir / "model.safetensors.index.json"
        if index.is_file():
            self.files = {name: hf_dir / f for name, f in json.loads(index.read_text())["weight_map"].items()}
        elif (hf_dir / "model.safetensors").is_file():
            single = hf_dir / "model.safetensors"
            with safe_open(str(single), framework="pt") as handle:
                self.files = {name: single for name in handle.keys()}
        else:
            raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {hf_dir}")
        self._open: dict[Path, object] = {}

    def read(self, name: str, rows: slice = slice(None)) -> torch.Tensor:
        if name not in self.files:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        path = self.files[name]
        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="pt").__enter__()
        return self._open[path].get_slice(name)[rows]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for handle in self._open.values():
            handle.__exit__(None, None, None)
        self._open.clear()
