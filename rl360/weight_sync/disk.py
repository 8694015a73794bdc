"""`disk`: the buckets are written as safetensors shards into a new directory under `scratch_dir` (default: the
system's temporary directory; it must be visible to every engine), then every engine gets
`/update_weights_from_disk` with that `model_path`; the directory is removed once every engine answered.
`rl360 serve rollout` loads just the safetensors files into its model (no config.json needed); real SGLang loads
a directory through its model loader, which also wants the checkpoint's config.json."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from rl360.core.wire import owning_copies
from rl360.weight_sync.calls import EngineCalls
from rl360.weight_sync.registry import SyncOptions, register_strategy


@register_strategy("disk", summary="a safetensors checkpoint the engines load", engines=("server", "sglang"))
class DiskSync:
    def __init__(self, calls: EngineCalls, scratch_dir: str | None):
        self.calls, self.scratch_dir = calls, scratch_dir

    @classmethod
    def from_options(cls, calls: EngineCalls, options: SyncOptions) -> DiskSync:
        return cls(calls, options.scratch_dir)

    def reset(self) -> None:
        """Nothing is held with the engines between updates."""

    def send(self, stream: Iterator[tuple[list, bool]], version: int) -> None:
        from safetensors.torch import save_file

        directory = Path(tempfile.mkdtemp(prefix=f"rl360-weights-v{version}-", dir=self.scratch_dir))
        try:
            for index, (bucket, _) in enumerate(stream):
                save_file(owning_copies(bucket), str(directory / f"shard-{index:05d}.safetensors"))
            self.calls.raise_failures(self.calls.to_all(
                lambda client: client.update_weights_from_disk(str(directory), version)))
        finally:
            shutil.rmtree(directory, ignore_errors=True)

