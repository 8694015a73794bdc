"""Per-architecture name/layout tables. Adding an architecture is one small file plus a line here."""

from megatron_bridge.arch.base import Architecture
from megatron_bridge.arch.qwen2 import QWEN2

ARCHITECTURES: dict[str, Architecture] = {arch_name: arch for arch in (QWEN2,) for arch_name in arch.hf_architectures}


def get_architecture(hf_architectures: list[str] | None) -> Architecture:
    for name in hf_architectures or []:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    raise ValueError(
        f"config.json architectures={hf_architectures} is not supported; supported: {sorted(ARCHITECTURES)}"
    )
