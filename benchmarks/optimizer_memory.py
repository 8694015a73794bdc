"""Per-rank memory of the policy's state with the replicated optimizer, the distributed one (ZeRO-1) and
offload, at DP=2, from one run.

    python benchmarks/optimizer_memory.py [--layers 8] [--dtype bfloat16] [--json FILE]

Two data-parallel policy ranks (gloo on CPU; NCCL where there are two GPUs) train a Qwen2-shaped random model
for two updates in each of three layouts: `replicated` (every rank keeps the whole Adam state), `distributed`
(`actor.distributed_optimizer=true`) and `distributed_offload` (with `actor.offload=true`). Printed per layout,
from rank 0: the bytes of its optimizer state (Adam's moments, and the fp32 main weights of bf16 parameters),
gradient buffer and weights, what of it stays in device memory between calls, and the process's peak resident
memory; and each figure over the replicated layout's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
LAYOUTS = {
    "replicated": [],
    "distributed": ["actor.distributed_optimizer=true"],
    "distributed_offload": ["actor.distributed_optimizer=true", "actor.offload=true"],
}


def make_model(out_dir: Path, layers: int) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False)
    Qwen2ForCausalLM(config).save_pretrained(out_dir)
    return str(out_dir)


def rank(model_dir: str, out_file: str, dtype: str, extra: str) -> None:
    """One data-parallel rank: two updates, then its state's bytes and peak memory into `out_file`."""
    from rl360.actor.policy import PolicyWorker
    from rl360.actor.settings import PolicySettings
    from rl360.config import load_config
    from tests.dp_worker import fixed_batch

    cfg = load_config(None, [f"model.path={model_dir}", "data.train_files=[unused.parquet]", "rollout.n=4",
                             "data.batch_size=4", "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=4",
                             "actor.parallel.data=2", f"model.dtype={dtype}", *filter(None, extra.split(" "))])
    worker = PolicyWorker(PolicySettings.of(cfg), rank=int(os.environ["RANK"]), world_size=2,
                          master_port=int(os.environ["MASTER_PORT"]))
    half, dp_rank = len(fixed_batch()) // 2, worker.layout()["dp_rank"]
    for _ in range(2):
        batch = fixed_batch().select(slice(dp_rank * half, (dp_rank + 1) * half))
        batch.old_logprobs = worker.compute_logprobs(batch) - 0.05
        worker.update(batch)
    total = worker.state_bytes()
    resident = worker.offload.resident_bytes() if worker.offload is not None else total
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if torch.distributed.get_rank() == 0:
        Path(out_file).write_text(json.dumps({"state_bytes": total, "resident_between_calls": resident,
                                              "peak_rss_bytes": peak_kib * 1024}))


def main(argv: list[str] | None = None) -> None:
    from rl360.cluster.launch import run_ranks

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    os.chdir(REPO)  # the ranks import this module as benchmarks.optimizer_memory
    results = {}
    with tempfile.TemporaryDirectory(prefix="rl360-zero-") as tmp:
        model = make_model(Path(tmp) / "model", args.layers)
        for name, extra in LAYOUTS.items():
            out = Path(tmp) / f"{name}.json"
            run_ranks("benchmarks.optimizer_memory:rank", 2, [model, str(out), args.dtype, " ".join(extra)],
                      timeout_s=1200)
            results[name] = json.loads(out.read_text())
    params = results["replicated"]["state_bytes"]["weights"] // (2 if args.dtype == "bfloat16" else 4)
    base = results["replicated"]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    print(f"Qwen2-shaped, {args.layers} layers, {params / 1e6:.1f}M parameters, {args.dtype}, DP=2; rank 0; {device}")
    print(f"{'layout':20} {'optimizer MB':>13} {'x':>6} {'resident MB':>12} {'x':>6} {'peak RSS MB':>12} {'x':>6}")
    for name, run in results.items():
        optimizer = run["state_bytes"]["optimizer"]
        resident = sum(run["resident_between_calls"].values())
        run["optimizer_over_replicated"] = optimizer / base["state_bytes"]["optimizer"]
        run["resident_over_replicated"] = resident / sum(base["resident_between_calls"].values())
        run["peak_rss_over_replicated"] = run["peak_rss_bytes"] / base["peak_rss_bytes"]
        print(f"{name:20} {optimizer / 1e6:13.1f} {run['optimizer_over_replicated']:6.2f} {resident / 1e6:12.1f} "
              f"{run['resident_over_replicated']:6.2f} {run['peak_rss_bytes'] / 1e6:12.1f} "
              f"{run['peak_rss_over_replicated']:6.2f}")
    print("resident: weights + gradients + optimizer state held in device memory between calls "
          "(on a CPU the offloaded part moves to another host buffer, so peak RSS does not fall with offload)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": " ".join(["python benchmarks/optimizer_memory.py", *(sys.argv[1:] if argv is None else argv)]),
            "machine": f"{platform.machine()}, {device}", "parameters": params, "dtype": args.dtype,
            "runs": results}, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
