"""What a run's config needs installed beyond the CPU defaults, checked before anything starts: GPU-only packages
(SGLang, Transformer Engine), a CUDA device for them, and sglang-router. Each missing piece is one `ConfigError`
naming the key that asks for it and what to install; nothing is imported (a package is looked up, not loaded)."""

from __future__ import annotations

import glob
import importlib.util
from typing import Any

from rl360.config import ConfigError

GPU_EXTRA = "pip install 'rl360[gpu]' (sglang==0.5.17, transformer-engine==2.11.0: launchers/versions.env)"
ROUTER_EXTRA = "pip install 'rl360[router]' (sglang-router==0.3.2)"


def has_package(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def has_cuda_device() -> bool:
    """Whether the machine shows an NVIDIA device (its device files), without importing torch."""
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def check_sglang(key: str) -> None:
    """SGLang engines, asked for by `key` (`rollout.engine=sglang`, `eval.engine=sglang`), need SGLang and a GPU."""
    if not has_package("sglang"):
        raise ConfigError(f"{key}=sglang needs SGLang, which is not installed here: {GPU_EXTRA}; or use "
                          f"{key}=server (rl360 serve rollout: SGLang's API on the HF engine, CPU or GPU)")
    if not has_cuda_device():
        raise ConfigError(f"{key}=sglang needs a CUDA GPU and this machine shows none (no /dev/nvidia*); use "
                          f"{key}=server on a CPU machine")


def check_installed(cfg: Any) -> None:
    """A `ConfigError` for the first thing a run's `cfg` asks for that this machine lacks."""
    if cfg.rollout.engine == "sglang":
        check_sglang("rollout.engine")
    if cfg.model.attention == "te":
        if not has_package("transformer_engine"):
            raise ConfigError(f"model.attention=te needs Transformer Engine, which is not installed here: {GPU_EXTRA};"
                              " or use model.attention=auto (Transformer Engine where it runs, else torch)")
        if not has_cuda_device():
            raise ConfigError("model.attention=te needs a CUDA GPU and this machine shows none (no /dev/nvidia*); "
                              "use model.attention=auto or torch")
    if cfg.rollout.router == "sglang" and not has_package("sglang_router"):
        raise ConfigError(f"rollout.router=sglang needs sglang-router, which is not installed here: {ROUTER_EXTRA}; "
                          "or use rollout.router=fleet (the fleet dispatches to its engines itself)")
