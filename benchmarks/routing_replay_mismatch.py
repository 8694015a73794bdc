"""The trainer/engine log-prob mismatch of a mixture of experts with and without routing replay, from one run:

    python benchmarks/routing_replay_mismatch.py [--samples 64] [--tokens 24]

For a tiny random Qwen3-MoE and Qwen2-MoE (4 experts, top-2, 2 layers), in bf16 and fp32: the HF engine samples
`--samples` responses of up to `--tokens` tokens and returns each token's experts; the Megatron policy computes
the log-probs of the same tokens routing by its own router scores, then replaying the engine's experts
(`actor.moe_routing_replay`). Printed side by side: mean and max |trainer - engine| per response token. Writes
benchmarks/results/routing_replay_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rl360.actor.batch import build_batch  # noqa: E402
from rl360.actor.parallel import init_parallel  # noqa: E402
from rl360.actor.policy import PolicyWorker  # noqa: E402
from rl360.actor.settings import PolicySettings  # noqa: E402
from rl360.config import load_config  # noqa: E402
from rl360.core import SamplingParams  # noqa: E402
from rl360.engine.hf_engine import HFEngine  # noqa: E402
from tests.helpers import make_tiny_model  # noqa: E402


def engine_batch(model_dir: str, dtype: str, samples: int, tokens: int):
    prompts = [[3 + i % 40, 4 + i % 7, 5, 6 + i % 11, 7][: 3 + i % 3] for i in range(samples // 4)]
    groups = HFEngine(model_dir, dtype=getattr(torch, dtype)).generate(prompts, SamplingParams(
        n=4, max_new_tokens=tokens, temperature=1.0, seed=1, routed_experts=True))
    drawn = [s for group in groups for s in group]
    return build_batch([s.prompt_ids for s in drawn], [s.response_ids for s in drawn], [s.logprobs for s in drawn],
                       routed_experts=[s.routed_experts for s in drawn])


def measure(model_dir: str, dtype: str, replay: bool, batch) -> dict[str, float]:
    cfg = load_config(None, [f"model.path={model_dir}", "data.train_files=[unused.parquet]", "rollout.n=4",
                             "data.batch_size=4", "actor.ppo_mini_batch_size=2", "actor.micro_batch_size=64",
                             "rollout.temperature=1.0", f"model.dtype={dtype}",
                             f"actor.moe_routing_replay={str(replay).lower()}"])
    logprobs = PolicyWorker(PolicySettings.of(cfg)).compute_logprobs(batch)
    diff = (logprobs - batch.rollout_logprobs).abs() * batch.response_mask
    return {"mean_abs_diff": diff.sum().item() / batch.response_mask.sum().item(), "max_abs_diff": diff.max().item()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=24)
    args = parser.parse_args(argv)
    init_parallel(1, 1, seed=0)
    rows = {}
    print(f"{'model':<10} {'dtype':<9} {'mean |diff| own':>16} {'with replay':>12} {'max own':>9} {'with replay':>12}")
    with tempfile.TemporaryDirectory() as root:
        for arch in ("qwen3_moe", "qwen2_moe"):
            model_dir = make_tiny_model(str(Path(root) / arch), arch, tie_word_embeddings=False, seed=21,
                                        num_layers=2)
            for dtype in ("bfloat16", "float32"):
                batch = engine_batch(model_dir, dtype, args.samples, args.tokens)
                own, replayed = (measure(model_dir, dtype, replay, batch) for replay in (False, True))
                rows[f"{arch}_{dtype}"] = {"own_routing": own, "routing_replay": replayed,
                                           "response_tokens": int(batch.response_mask.sum())}
                print(f"{arch:<10} {dtype:<9} {own['mean_abs_diff']:>16.3e} {replayed['mean_abs_diff']:>12.3e} "
                      f"{own['max_abs_diff']:>9.3e} {replayed['max_abs_diff']:>12.3e}")
    command = "python benchmarks/routing_replay_mismatch.py" + (
        f" --samples {args.samples}" if args.samples != 64 else "") + (
        f" --tokens {args.tokens}" if args.tokens != 24 else "")
    result = {"command": command, "device": f"CPU ({platform.processor() or platform.machine()})", "runs": rows}
    out = REPO / "benchmarks" / "results" / "routing_replay_cpu.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
