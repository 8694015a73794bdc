"""The numbers of an evaluation report, per data_source and overall.

- `pass_at_k(n, c, k)`: the unbiased estimator of Chen et al. 2021 (Codex paper), `1 - C(n-c, k) / C(n, k)`,
  the chance that at least one of k samples drawn without replacement from the n is correct, computed as a
  product to stay exact for large n; averaged over prompts.
- `maj@n`: per prompt, the answer (`rl360.rewards.judge.stated_answer`: last \\boxed{}, else <answer>) most of
  its n samples give, ties to the one seen first; the prompt counts as correct when that answer's first sample
  is. Samples that state no answer (neither) do not vote.
- A sample is correct when its score is 1 (partial credit counts in `accuracy`, the mean score, only).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt with `c` correct of `n` samples."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


@dataclass
class SampleOutcome:
    score: float
    answer: str | None  # the extracted answer (maj@k's vote)
    tokens: int
    truncated: bool
    timed_out: bool  # the reward call
    error: bool  # the request or the reward failed


def majority_correct(samples: list[SampleOutcome]) -> bool:
    votes = Counter(s.answer for s in samples if s.answer)
    if not votes:
        return False
    top = max(votes.values())
    winner = next(s for s in samples if s.answer and votes[s.answer] == top)
    return winner.score >= 1.0


def summarize(groups: list[list[SampleOutcome]], ks: list[int]) -> dict[str, float]:
    """The metrics over `groups` (one list of samples per prompt, all of the same size n)."""
    samples = [s for group in groups for s in group]
    if not samples:
        return {}
    n = len(groups[0])
    lengths = sorted(s.tokens for s in samples)
    metrics: dict[str, float] = {"prompts": len(groups), "samples": len(samples),
                                 "accuracy": sum(s.score for s in samples) / len(samples)}
    for k in ks:
        metrics[f"pass@{k}"] = sum(pass_at_k(n, sum(s.score >= 1.0 for s in g), k) for g in groups) / len(groups)
    metrics[f"maj@{n}"] = sum(majority_correct(g) for g in groups) / len(groups)
    metrics.update({"response_tokens_mean": sum(lengths) / len(lengths), "response_tokens_max": lengths[-1],
                    "response_tokens_median": lengths[len(lengths) // 2],
                    "truncated_rate": sum(s.truncated for s in samples) / len(samples),
                    "reward_timeouts": sum(s.timed_out for s in samples), "errors": sum(s.error for s in samples)})
    return metrics
