"""Optimizer state and update time of LoRA against full training, measured on a real policy and planned.

    python benchmarks/lora_memory.py [--rank 64] [--layers 8] [--dtype bfloat16] [--json FILE]

One policy rank (TP=1) trains a Qwen2-shaped random model (hidden 512, 8 layers, vocabulary 32000) in two runs:
full training and LoRA (`actor.lora.rank`, every linear). Printed for each: the bytes of its optimizer state
(Adam's moments and the fp32 main weights of bf16 parameters, as `PolicyWorker.state_bytes` counts the tensors
megatron's optimizer holds), the figure `rl360 plan` computes for the same config, and the median time of an
update (forward, backward and optimizer step over one mini-batch); then LoRA over full for each. Last, the plan's
optimizer figures at the same LoRA rank on the released Qwen2.5-1.5B shape.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def make_model(out_dir: Path, layers: int) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False)
    Qwen2ForCausalLM(config).save_pretrained(out_dir)
    return str(out_dir)


def overrides(model_dir: str, dtype: str, rank: int) -> list[str]:
    return [f"model.path={model_dir}", "data.train_files=[unused.parquet]", "rollout.n=4", "data.batch_size=4",
            "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=8", f"model.dtype={dtype}",
            "algorithm.kl_coef=0", f"actor.lora.rank={rank}", "actor.lora.alpha=128", "actor.lora.targets=[all-linear]",
            "data.max_prompt_length=64", "rollout.max_response_length=64"]


def measure(model_dir: str, dtype: str, rank: int, updates: int) -> dict:
    """Optimizer bytes (measured, planned) and update times of one run."""
    from rl360.actor.policy import PolicyWorker
    from rl360.actor.settings import PolicySettings
    from rl360.config import load_config
    from rl360.plan import plan
    from tests.dp_worker import fixed_batch

    cfg = load_config(None, overrides(model_dir, dtype, rank))
    worker = PolicyWorker(PolicySettings.of(cfg))
    times = []
    for step in range(updates + 1):
        batch = fixed_batch()
        batch.old_logprobs = worker.compute_logprobs(batch) - 0.05
        start = time.perf_counter()
        worker.update(batch)
        if step:  # the first update creates Adam's state
            times.append(time.perf_counter() - start)
    planned = next(term.bytes for term in plan(cfg).terms if term.name.startswith("policy optimizer"))
    trainable = sum(p.numel() for p in worker.models[0].parameters() if p.requires_grad)
    return {"optimizer_bytes": worker.state_bytes()["optimizer"], "planned_optimizer_bytes": int(planned),
            "trainable_parameters": trainable, "update_s_median": statistics.median(times), "update_s": times}


def released_plan(rank: int) -> dict:
    from rl360.config import load_config
    from rl360.plan import plan

    figures = {}
    for name, lora in (("full", 0), ("lora", rank)):
        cfg = load_config(str(REPO / "configs/quickstart.yaml"), ["model.path=Qwen/Qwen2.5-1.5B-Instruct",
                                                                  "model.dtype=bfloat16", f"actor.lora.rank={lora}"])
        figures[name] = int(next(t.bytes for t in plan(cfg).terms if t.name.startswith("policy optimizer")))
    figures["lora_over_full"] = figures["lora"] / figures["full"]
    return figures


def main(argv: list[str] | None = None) -> None:
    from rl360.actor.parallel import init_parallel

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))  # tests.dp_worker's fixed batch
    init_parallel(1, 1)
    with tempfile.TemporaryDirectory(prefix="rl360-lora-") as tmp:
        model = make_model(Path(tmp) / "model", args.layers)
        runs = {"full": measure(model, args.dtype, 0, args.updates),
                "lora": measure(model, args.dtype, args.rank, args.updates)}
    full, lora = runs["full"], runs["lora"]
    ratios = {"optimizer_measured": lora["optimizer_bytes"] / full["optimizer_bytes"],
              "optimizer_planned": lora["planned_optimizer_bytes"] / full["planned_optimizer_bytes"],
              "update_time": lora["update_s_median"] / full["update_s_median"]}
    print(f"model: Qwen2 shape, hidden 512, {args.layers} layers, vocabulary 32000, {args.dtype}; LoRA rank "
          f"{args.rank} on every linear")
    print(f"{'':6} {'trainable':>12} {'optimizer MiB':>14} {'planned MiB':>12} {'update s':>9}")
    for name, run in runs.items():
        print(f"{name:6} {run['trainable_parameters']:12,} {run['optimizer_bytes'] / 2**20:14.1f} "
              f"{run['planned_optimizer_bytes'] / 2**20:12.1f} {run['update_s_median']:9.3f}")
    print(f"LoRA / full: optimizer state {ratios['optimizer_measured']:.4f} measured, "
          f"{ratios['optimizer_planned']:.4f} planned; update time {ratios['update_time']:.3f}")
    released = released_plan(args.rank)
    print(f"rl360 plan, Qwen2.5-1.5B shape, rank {args.rank}: optimizer {released['lora'] / 2**30:.2f} GiB LoRA "
          f"against {released['full'] / 2**30:.2f} GiB full = {released['lora_over_full']:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": "python benchmarks/lora_memory.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": f"{platform.machine()}, "
                       f"{'GPU ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'} "
                       f"({os.cpu_count()} cores)",
            "rank": args.rank, "layers": args.layers, "dtype": args.dtype, "runs": runs, "lora_over_full": ratios,
            "plan_qwen2.5_1.5b": released}, indent=1) + "\n")


if __name__ == "__main__":
    main()
