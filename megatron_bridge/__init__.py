"""Hugging Face <-> megatron-core: config mapping, per-architecture name/layout tables, streamed export.

`Bridge` is imported on first use, so that the light modules of the package (`layer_spec`'s names, `lora`'s
targets), which a config check reads, do not load megatron-core.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_bridge.bridge import Bridge

__all__ = ["Bridge"]


def __getattr__(name: str) -> Any:
    if name == "Bridge":
        from megatron_bridge.bridge import Bridge

        return Bridge
    raise AttributeError(f"module 'megatron_bridge' has no attribute {name!r}")
