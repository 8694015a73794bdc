"""Colocated weight-sync bandwidth: full weight updates into one `rl360 serve rollout` engine on the same device,
by CUDA IPC (`rl360_cuda_ipc`) beside the host path (`rl360_shared_memory`), from one run.

    python benchmarks/weight_sync_bandwidth.py [--shape qwen2.5-1.5b|small] [--bucket-mb 64] [--repeats 3]
                                               [--json FILE]

The weights: random bfloat16 tensors with the Hugging Face names and shapes of the chosen model (`qwen2.5-1.5b`:
Qwen2.5-1.5B, 1.54 B parameters, 3.09 GB; `small`: a 37 M-parameter Qwen2), on the GPU where there is one,
grouped into buckets of at most `--bucket-mb` MiB (default: `trainer.weight_bucket_mb`; a larger tensor travels
alone), as the trainer groups them. The engine serves a checkpoint of that shape (config.json and zero weights
written to a temporary directory) in bfloat16 on the same device, as colocated engines do. Each path sends one
warm-up update, then `--repeats` timed ones through `WeightSender(strategy="tensor")`: `cuda_ipc` packs each
bucket into a CUDA buffer the engine copies from device to device; `shared_memory` (`cuda_ipc=False`) copies each
bucket to the host, into a /dev/shm file the engine maps and copies back to its device. Both start from the same
GPU tensors and end when the engine has swapped the update in. Printed per path: GB/s (10^9 bytes of one copy of
the weights per second) of the best and the median update, and CUDA IPC over shared memory. After each path's
last update a few weights are read back (`/get_weights_by_name`) and compared with what was sent.

Without CUDA only the shared-memory path runs (default shape `small`), and the CUDA IPC figure is reported as
needing a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

KEY = "weight-sync-bandwidth-key-0123456789"
KEY_ENV = "RL360_WEIGHT_SYNC_BENCH_KEY"
SHAPES = {  # Qwen2Config fields
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                         rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "small": dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                  rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
}
CHECKED = ("model.norm.weight", "model.layers.0.self_attn.q_proj.bias", "model.embed_tokens.weight")


def parameter_shapes(shape: str) -> tuple[object, list[tuple[str, tuple[int, ...]]]]:
    """The model's config and its parameters' (hf_name, shape), tied weights once (as the engine lists them)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SHAPES[shape])
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    return config, [(name, tuple(param.shape)) for name, param in model.named_parameters()]


def write_checkpoint(config, shapes: list[tuple[str, tuple[int, ...]]], out_dir: Path) -> None:
    """config.json and one safetensors file of zeros: what the engine loads before the first update."""
    from safetensors.torch import save_file

    config.save_pretrained(out_dir)
    save_file({name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in shapes},
              str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def bucketed(named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive tensors in buckets of at most `bucket_bytes` (a larger tensor alone)."""
    buckets: list[list[tuple[str, torch.Tensor]]] = []
    current: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append((name, tensor))
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


class Engine:
    """`rl360 serve rollout` on `model_dir` in bfloat16, as a process; its output is kept for errors."""

    def __init__(self, model_dir: str):
        env = {**os.environ, KEY_ENV: KEY, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                                                        os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen([sys.executable, "-m", "rl360.cli", "serve", "rollout", "--model", model_dir,
                                      "--port", "0", "--dtype", "bfloat16", "--api-key-env", KEY_ENV,
                                      "--batch-window-ms", "1", "--shutdown-grace", "5"],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.output: list[str] = []
        while not self.output or "serving" not in self.output[-1]:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("the engine exited before serving:\n" + "".join(self.output[-40:]))
            self.output.append(line)
        self.url = self.output[-1].split(" on ", 1)[1].split()[0]
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def read_back(url: str, named: dict[str, torch.Tensor]) -> None:
    """A few weights as the engine serves them equal what was sent (bfloat16 reads back exactly)."""
    import asyncio

    from rl360.core.client import EngineClient

    async def read() -> dict[str, list]:
        async with EngineClient(url, api_key=KEY, timeout_s=120) as client:
            return {name: await client.get_weights_by_name(name, 4) for name in CHECKED}

    for name, rows in asyncio.run(read()).items():
        sent = named[name][:4].float().cpu()
        if not torch.equal(torch.tensor(rows, dtype=torch.float32), sent):
            raise AssertionError(f"the engine serves {name} other than it was sent")


def run_path(path: str, url: str, buckets: list, named: dict, repeats: int, version: int) -> tuple[list[float], int]:
    """One warm-up and `repeats` timed full updates by `path`; their seconds and the next free version."""
    from rl360.weight_sync.sender import WeightSender

    seconds = []
    with WeightSender([url], "tensor", api_key=KEY, timeout_s=600, cuda_ipc=path == "cuda_ipc") as sender:
        for attempt in range(repeats + 1):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            started = time.perf_counter()
            sender.send(buckets, version)
            elapsed = time.perf_counter() - started
            version += 1
            if attempt:
                seconds.append(elapsed)
            print(f"  {path}: update {attempt} ({'timed' if attempt else 'warm-up'}) {elapsed:.3f} s", file=sys.stderr,
                  flush=True)
    read_back(url, named)
    return seconds, version


def main(argv: list[str] | None = None) -> None:
    from rl360.config import TrainerConfig

    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b" if cuda else "small")
    parser.add_argument("--bucket-mb", type=float, default=TrainerConfig.weight_bucket_mb,
                        help="bucket bound in MiB (trainer.weight_bucket_mb)")
    parser.add_argument("--repeats", type=int, default=3, help="timed updates per path (after one warm-up)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.bucket_mb <= 0:
        parser.error("--repeats must be >= 1 and --bucket-mb positive")

    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    device_name = torch.cuda.get_device_name(device) if cuda else f"CPU ({os.cpu_count()} cores)"
    config, shapes = parameter_shapes(args.shape)
    generator = torch.Generator(device=device).manual_seed(0)
    named = [(name, torch.randn(shape, generator=generator, device=device, dtype=torch.bfloat16))
             for name, shape in shapes]
    buckets = bucketed(named, int(args.bucket_mb * (1 << 20)))
    total = sum(tensor.numel() * tensor.element_size() for _, tensor in named)
    parameters = sum(tensor.numel() for _, tensor in named)
    paths = ["shared_memory", "cuda_ipc"] if cuda else ["shared_memory"]

    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="rl360-weight-sync-bench-") as tmp:
        print(f"writing a {args.shape} checkpoint of zeros and starting the engine ...", file=sys.stderr, flush=True)
        write_checkpoint(config, shapes, Path(tmp))
        engine = Engine(tmp)
        try:
            version = 1
            for path in paths:
                seconds, version = run_path(path, engine.url, buckets, dict(named), args.repeats, version)
                runs[path] = {"seconds": seconds, "best_gb_per_s": total / min(seconds) / 1e9,
                              "median_gb_per_s": total / statistics.median(seconds) / 1e9}
        finally:
            engine.stop()

    print(f"\nweight sync into one rl360 serve rollout engine on the same device: {device_name}")
    print(f"{args.shape} shape: {parameters:,} parameters, {total / 1e9:.2f} GB bf16, {len(buckets)} buckets of "
          f"<= {args.bucket_mb:g} MiB, {args.repeats} timed updates per path after one warm-up")
    print(f"{'path':<15}{'best GB/s':>12}{'median GB/s':>14}{'best s':>10}")
    for path in ("shared_memory", "cuda_ipc"):
        if path in runs:
            run = runs[path]
            print(f"{path:<15}{run['best_gb_per_s']:>12.2f}{run['median_gb_per_s']:>14.2f}{min(run['seconds']):>10.3f}")
        else:
            print(f"{path:<15}{'needs a GPU (no CUDA device here)':>36}")
    ratio = None
    if "cuda_ipc" in runs:
        ratio = {"best": runs["cuda_ipc"]["best_gb_per_s"] / runs["shared_memory"]["best_gb_per_s"],
                 "median": runs["cuda_ipc"]["median_gb_per_s"] / runs["shared_memory"]["median_gb_per_s"]}
        print(f"cuda_ipc / shared_memory: {ratio['best']:.1f}x (best), {ratio['median']:.1f}x (median)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": " ".join(["python benchmarks/weight_sync_bandwidth.py",
                                 *(sys.argv[1:] if argv is None else argv)]),
            "device": device_name, "machine": f"{platform.machine()}, {device_name}", "torch": torch.__version__,
            "shape": args.shape, "parameters": parameters, "bytes": total, "dtype": "bfloat16",
            "buckets": len(buckets), "bucket_mb": args.bucket_mb, "repeats": args.repeats, "runs": runs,
            "cuda_ipc_over_shared_memory": ratio,
            "cuda_ipc": None if cuda else "needs a GPU: not measured on this machine",
        }, indent=1) + "\n")


if __name__ == "__main__":
    main()
