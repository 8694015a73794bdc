"""Hugging Face <-> megatron-core: config mapping, per-architecture name/layout tables, streamed export."""

from megatron_bridge.bridge import Bridge

__all__ = ["Bridge"]
