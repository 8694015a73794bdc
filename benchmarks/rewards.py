"""Throughput of math rewards: the RewardPool against a plain sequential loop, from one run.

    python benchmarks/rewards.py --n 20000 --workers 2

Builds `n` math responses (right and wrong answers: integers, fractions, LaTeX expressions, some
without a box), scores them once with `RewardPool(num_workers=workers)` and once in a plain loop in this
process (`compute_score`, no timeout, no worker processes), checks that both give the same scores, and
prints both throughputs (responses per second) and their ratio. The pool's figure includes starting and
closing its workers. The two alternate chunk by chunk (`--chunk`), so that on a shared machine both
meet the same load; the 1-minute load average is printed beside the figures.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rl360.rewards import RewardItem, RewardPool, compute_score  # noqa: E402

_TRUTHS = [("2", ["2", "2.0", "3", "\\frac{4}{2}"]), ("\\frac{1}{2}", ["\\frac{1}{2}", "0.5", "\\frac12", "1/3"]),
           ("x^2+1", ["x^2+1", "1+x^2", "x^2-1", "(x+1)^2"]), ("\\sqrt{2}", ["\\sqrt{2}", "2^{1/2}", "1.41", "2"]),
           ("12", ["12", "012", "\\text{12}", "21"]), ("\\pi", ["\\pi", "3.14159", "\\frac{\\pi}{1}", "2\\pi"])]


def make_items(n: int, seed: int = 0) -> list[RewardItem]:
    """`n` math responses: a short derivation ending in a boxed (or, 1 in 10, unboxed) answer."""
    rng = random.Random(seed)
    items = []
    for index in range(n):
        truth, answers = rng.choice(_TRUTHS)
        answer = rng.choice(answers)
        ending = f"The answer is \\boxed{{{answer}}}." if rng.random() > 0.1 else f"The answer is {answer}."
        response = f"<think>Let me compute step {index}.</think> We simplify the expression. {ending}"
        items.append(RewardItem(f"math__bench{index % 3}", response, truth))
    return items


def sequential(items: list[RewardItem]) -> list[float]:
    scores = []
    for item in items:
        value = compute_score(item.data_source, item.solution_str, item.ground_truth, item.extra_info)
        scores.append(float(value["score"] if isinstance(value, dict) else value))
    return scores


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=20000, help="responses to score")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2, help="RewardPool worker processes")
    parser.add_argument("--chunk", type=int, default=2000, help="responses per alternation between the two")
    parser.add_argument("--timeout", type=float, default=10.0, help="RewardPool per-call timeout (s)")
    args = parser.parse_args(argv)
    items = make_items(args.n)

    # Alternate chunks between the two, so that both meet the same load on a shared machine.
    chunks = [items[start:start + args.chunk] for start in range(0, len(items), args.chunk)]
    pool_results, loop_scores, pool_s, loop_s = [], [], 0.0, 0.0
    started = time.perf_counter()
    pool = RewardPool(num_workers=args.workers, timeout_s=args.timeout)
    pool_s += time.perf_counter() - started  # starting the workers counts against the pool
    timeouts = errors = 0.0
    try:
        for chunk in chunks:
            started = time.perf_counter()
            pool_results += pool.score(chunk)
            pool_s += time.perf_counter() - started
            timeouts += pool.last_metrics()["reward/timeouts"]
            errors += pool.last_metrics()["reward/errors"]
            started = time.perf_counter()
            loop_scores += sequential(chunk)
            loop_s += time.perf_counter() - started
    finally:
        started = time.perf_counter()
        pool.close()
        pool_s += time.perf_counter() - started
    metrics = {"reward/timeouts": timeouts, "reward/errors": errors}

    pool_scores = [result.score for result in pool_results]
    mismatches = sum(a != b for a, b in zip(pool_scores, loop_scores))
    print(f"{args.n} math responses, {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f}, "
          f"mean score {sum(loop_scores) / args.n:.3f}")
    print(f"RewardPool ({args.workers} workers): {pool_s:8.2f} s  {args.n / pool_s:9.1f} responses/s  "
          f"(timeouts {metrics['reward/timeouts']:.0f}, errors {metrics['reward/errors']:.0f})")
    print(f"sequential loop (1 process):  {loop_s:8.2f} s  {args.n / loop_s:9.1f} responses/s")
    print(f"speed-up (pool / loop): {loop_s / pool_s:.2f}x   score mismatches: {mismatches}")


if __name__ == "__main__":
    main()
