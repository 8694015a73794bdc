"""Policy-update throughput: fixed micro-batches, token budgets and packed sequences, from one run.

    python benchmarks/micro_batching.py [--rows 64] [--micro 8] [--repeats 3] [--json FILE]

One Megatron policy rank (this process, gloo, CPU or the GPU there is) with a Qwen2-shaped random model; a
batch of `--rows` responses whose lengths spread as RL responses do (prompts 32-128 tokens, responses from a
log-normal around 200 tokens, capped at 1,024). The same gradient is computed (`accumulate_gradients`: every
micro-batch's forward and backward) five ways:

- `local_fixed`: megatron's unfused local attention, `actor.micro_batch_size=--micro` (the policy before this
  work, except that each micro-batch is now cut to its own longest row);
- `fixed`: the same split on `model.attention=torch` (SDPA kernels);
- `token_budget`: `actor.max_tokens_per_micro_batch` = `--micro` x the batch's longest row (the largest
  micro-batch the fixed split may meet: the same peak activation size), rows longest first;
- `packed`: `actor.pack_sequences=true` with the same budget counted in real tokens (no padding at all).

Printed: real (unpadded) tokens per second of each, the tokens each computed (padding included), and each
run's throughput over `local_fixed`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rl360.actor.batch import build_batch
from rl360.actor.parallel import init_parallel
from rl360.actor.policy import PolicyWorker
from rl360.actor.settings import PolicySettings
from rl360.config import load_config


def make_model(out_dir: Path) -> str:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(out_dir)
    return str(out_dir)


def make_batch(rows: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for _ in range(rows):
        prompt_len = int(torch.randint(32, 129, (1,), generator=generator))
        response_len = int(min(1024, max(8, torch.empty(1).log_normal_(5.3, 0.8, generator=generator).item())))
        prompts.append(torch.randint(3, 4096, (prompt_len,), generator=generator).tolist())
        responses.append(torch.randint(3, 4096, (response_len,), generator=generator).tolist())
    batch = build_batch(prompts, responses, [[-1.0] * len(r) for r in responses])
    batch.advantages = torch.randn(batch.response_mask.shape, generator=generator) * batch.response_mask
    return batch


def timed(worker: PolicyWorker, batch, repeats: int) -> tuple[float, int]:
    worker.accumulate_gradients(batch)  # warm-up
    started = time.perf_counter()
    for _ in range(repeats):
        worker.accumulate_gradients(batch)
    seconds = (time.perf_counter() - started) / repeats
    micro = worker._micro_batches(batch)
    if worker.settings.actor.pack_sequences:
        padded = sum(int(mb.sequence_lengths().sum()) for mb in micro)
    else:
        padded = sum(len(mb) * mb.input_ids.shape[1] for mb in micro)
    return seconds, padded


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    init_parallel()
    batch = make_batch(args.rows)
    real_tokens = int(batch.sequence_lengths().sum())
    budget = args.micro * int(batch.sequence_lengths().max())
    with tempfile.TemporaryDirectory(prefix="rl360-micro-") as tmp:
        model = make_model(Path(tmp) / "model")
        common = [f"model.path={model}", "data.train_files=[unused.parquet]", "rollout.n=2", "algorithm.kl_coef=0",
                  f"data.batch_size={args.rows // 2}", f"actor.ppo_mini_batch_size={args.rows // 2}",
                  "model.attention=torch"]  # (local_fixed overrides it)
        runs = {}
        for name, extra in (("local_fixed", [f"actor.micro_batch_size={args.micro}", "model.attention=local"]),
                            ("fixed", [f"actor.micro_batch_size={args.micro}"]),
                            ("token_budget", [f"actor.max_tokens_per_micro_batch={budget}"]),
                            ("packed", [f"actor.max_tokens_per_micro_batch={budget}", "actor.pack_sequences=true"])):
            worker = PolicyWorker(PolicySettings.of(load_config(None, common + extra)))
            batch.old_logprobs = torch.full_like(batch.response_mask, -1.0)
            seconds, padded = timed(worker, batch, args.repeats)
            runs[name] = {"seconds": seconds, "tokens_per_s": real_tokens / seconds, "padded_tokens": padded}
            del worker
    for run in runs.values():
        run["over_local_fixed"] = run["tokens_per_s"] / runs["local_fixed"]["tokens_per_s"]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    print(f"{args.rows} responses, {real_tokens} real tokens, longest row {int(batch.sequence_lengths().max())}; "
          f"{device}")
    for name, run in runs.items():
        print(f"{name:13} {run['tokens_per_s']:10.0f} tokens/s  {run['seconds']:7.2f} s  "
              f"{run['padded_tokens']:7d} tokens computed  {run['over_local_fixed']:5.2f}x")
    print(f"budget {budget} tokens, fixed {args.micro} rows a micro-batch")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": " ".join(["python benchmarks/micro_batching.py", *(sys.argv[1:] if argv is None else argv)]),
            "machine": f"{platform.machine()}, {device}", "rows": args.rows, "real_tokens": real_tokens,
            "budget_tokens": budget, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
