"""The policy's weights out: to the engines after each update (in Hugging Face names, in bounded buckets, by the
run's weight-sync strategy) and as a Hugging Face checkpoint.

`PolicyExport` is a part of `rl360.actor.policy.PolicyWorker`; it reads the worker's `settings`, `models`, `bridge`,
`device` and `_resident` (the offload context).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from rl360.actor.parallel import unwrap


class PolicyExport:
    def export_weights(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Buckets of `(hf_name, tensor)` of the current policy (a Ray streaming generator). Every rank of
        data-parallel replica 0 must export at the same time (the gathers are collectives)."""
        bucket_bytes = int(self.settings.weight_bucket_mb * (1 << 20))
        with self._resident("weights"):
            yield from self.bridge.export_hf_weights([unwrap(m) for m in self.models], bucket_bytes=bucket_bytes)

    def export_weights_quietly(self) -> int:
        """Take part in an export whose buckets another rank streams; returns the bucket count."""
        return sum(1 for _ in self.export_weights())

    def send_weights(self, urls: list[str], strategy: str, version: int, api_key: str | None = None,
                     scratch_dir: str | None = None) -> dict[str, float]:
        """Export the policy straight into the engines at `urls` (`rollout.weight_sync`: distributed, tensor or
        disk); the rest of replica 0 runs `export_weights_quietly` meanwhile. The sender, and with it the
        distributed group, lives on between updates; a changed engine list (a restarted engine) re-creates it."""
        from rl360.weight_sync.sender import WeightSender

        sender = getattr(self, "_sender", None)
        if sender is None or sender.strategy != strategy:
            if sender is not None:
                sender.close()
            import ray

            sender = self._sender = WeightSender(
                urls, strategy, api_key=api_key, scratch_dir=scratch_dir, timeout_s=self.settings.request_timeout_s,
                backend="nccl" if self.device.type == "cuda" else "gloo", master_address=ray.util.get_node_ip_address())
        elif sender.urls != [url.rstrip("/") for url in urls]:
            sender.set_engines(list(urls))
        return sender.send(self.export_weights(), version)

    def save_hf(self, out_dir: str) -> str:
        with self._resident("weights"):
            self.bridge.save_hf_pretrained([unwrap(m) for m in self.models], out_dir)
        return out_dir
