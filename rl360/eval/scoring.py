"""Scoring an evaluation's samples and writing its report.

Every sample goes through the reward registry and pool as in training (`rl360.rewards.pool`, the config's
`reward` section: workers, timeouts, memory limits, sandbox isolation). With `rejudge`, the samples the rules
scored below 1 go to the LLM judge (`rl360.rewards.judge.JudgeClient`, `judge` section, template
`correctness`: "Correct" / "Incorrect" on the question, the reference and the sample's extracted answer);
a "Correct" makes the sample correct in the combined scores. The report has the rules' numbers (`rule`), the
judge's counts (`judge`) and, with the judge, the combined numbers (`combined`), each overall (`all`) and per
data_source (`metrics.summarize`). It depends only on the samples, so a resumed run's equals an unbroken one's.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl360.core import TrajectorySummary
from rl360.eval.inputs import EvalPrompt
from rl360.eval.metrics import SampleOutcome, summarize
from rl360.rewards.judge import JudgeClient, JudgeItem, JudgeResult, answer_for_judge, stated_answer
from rl360.rewards.pool import RewardItem, RewardResult

REPORT, ERRORS = "report.json", "errors.jsonl"


@dataclass
class ScoredSample:
    """One sample of `rl360 eval` with its reward (and the judge's verdict, when re-judged)."""

    prompt: EvalPrompt
    sample: int
    record: dict | None  # None: never answered (every retry failed)
    reward: RewardResult
    judge: JudgeResult | None = None

    @property
    def request_error(self) -> str | None:
        return "unanswered: every retry failed" if self.record is None else self.record.get("error")

    def outcome(self, combined: bool) -> SampleOutcome:
        record = self.record or {}
        score = self.reward.score
        if combined and self.judge is not None and self.judge.score == 1.0:
            score = 1.0
        return SampleOutcome(score, stated_answer(record.get("response", "")) or None, int(record.get("tokens", 0)),
                             record.get("finish_reason") == "length", self.reward.timed_out,
                             self.request_error is not None or (self.reward.error is not None
                                                                and not self.reward.timed_out))


def score_samples(prompts: list[EvalPrompt], results: dict[tuple[int, int], dict], n: int,
                  score: Callable[[list[RewardItem]], list[RewardResult]]) -> list[list[ScoredSample]]:
    """Every (prompt, sample) scored by its data_source's reward (`score`: a reward pool's), a multi-turn sample
    with its trajectory's summary; a missing one scores 0."""
    pairs = [(p, j, results.get((p.index, j))) for p in prompts for j in range(n)]
    items = [RewardItem(p.data_source, (rec or {}).get("response", ""), p.ground_truth, p.extra_info,
                        _trajectory(rec)) for p, _, rec in pairs]
    rewards = score(items)
    scored = [ScoredSample(p, j, rec, reward) for (p, j, rec), reward in zip(pairs, rewards)]
    return [scored[i * n:(i + 1) * n] for i in range(len(prompts))]


def _trajectory(record: dict | None) -> TrajectorySummary | None:
    summary = (record or {}).get("trajectory")
    return None if summary is None else TrajectorySummary.from_dict(summary)


def rejudge(groups: list[list[ScoredSample]], client: JudgeClient) -> None:
    """The judge's verdict on each answered sample the rules scored below 1 (set on `ScoredSample.judge`)."""
    misses = [s for group in groups for s in group if s.reward.score < 1.0 and s.request_error is None]
    items = [JudgeItem("correctness", question=s.prompt.question(), reference=s.prompt.ground_truth,
                       response=answer_for_judge(s.record["response"])) for s in misses]
    for s, result in zip(misses, client.score_batch(items) if items else []):
        s.judge = result


def build_report(n: int, ks: list[int], groups: list[list[ScoredSample]], judged: bool) -> dict[str, Any]:
    """The report of `groups` (n samples per prompt): the rules' numbers, and with `judged` the judge's counts and
    the combined numbers."""
    by_source: dict[str, list[list[ScoredSample]]] = defaultdict(list)
    for group in groups:
        by_source[group[0].prompt.data_source].append(group)

    def block(combined: bool) -> dict[str, Any]:
        def outcomes(gs):
            return [[s.outcome(combined) for s in g] for g in gs]

        return {"all": summarize(outcomes(groups), ks),
                "by_data_source": {src: summarize(outcomes(gs), ks) for src, gs in sorted(by_source.items())}}

    unanswered = sum(s.record is None for g in groups for s in g)
    report: dict[str, Any] = {"n": n, "pass_k": ks, "unanswered": unanswered, "rule": block(False)}
    if judged:
        def counts(gs):
            samples = [s for g in gs for s in g if s.judge is not None]
            return {"judged": len(samples), "rescued": sum(s.judge.score == 1.0 for s in samples),
                    "failures": sum(not s.judge.ok for s in samples)}

        report["judge"] = {"all": counts(groups),
                           "by_data_source": {src: counts(gs) for src, gs in sorted(by_source.items())}}
        report["combined"] = block(True)
    return report


def write_report(out: Path, report: dict[str, Any], groups: list[list[ScoredSample]]) -> int:
    """`report.json` (replaced whole) and `errors.jsonl` in `out`; how many rule failures."""
    tmp = out / (REPORT + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, sort_keys=True))
    tmp.replace(out / REPORT)
    return write_errors(out / ERRORS, groups)


def write_errors(path: Path, groups: list[list[ScoredSample]]) -> int:
    """Every sample the rules scored below 1 (with the judge's verdict when there is one); how many."""
    count = 0
    with open(path, "w", encoding="utf-8") as out:
        for group in groups:
            for s in group:
                if s.reward.score >= 1.0:
                    continue
                record = s.record or {}
                judge = None if s.judge is None else {"score": s.judge.score, "text": s.judge.text[:500],
                                                      "error": s.judge.error}
                out.write(json.dumps({
                    "prompt": s.prompt.index, "sample": s.sample, "data_source": s.prompt.data_source,
                    "question": s.prompt.question(), "ground_truth": s.prompt.ground_truth,
                    "response": record.get("response", ""), "answer": answer_for_judge(record.get("response", "")),
                    "score": s.reward.score, "reward_error": s.reward.error, "reward_timed_out": s.reward.timed_out,
                    "finish_reason": record.get("finish_reason"), "request_error": s.request_error, "judge": judge,
                    "correct_after_judge": bool(s.judge is not None and s.judge.score == 1.0)}) + "\n")
                count += 1
    return count


def report_table(report: dict[str, Any]) -> str:
    """The report as a plain-text table: one line per data_source, then all."""
    n, ks = report["n"], report["pass_k"]
    top_k = [k for k in ks if k != 1][-1:] or []
    judged = "combined" in report
    head = f"{'data_source':<32} {'prompts':>7} {'acc':>7} {'pass@1':>7}"
    head += "".join(f" {f'pass@{k}':>8}" for k in top_k) + f" {f'maj@{n}':>7}"
    head += f" {'acc+judge':>9}" if judged else ""
    head += f" {'tokens':>7} {'trunc':>6} {'timeouts':>8} {'errors':>6}"
    lines = [head]
    names = sorted(report["rule"]["by_data_source"]) + ["all"]
    for name in names:
        m = report["rule"]["all"] if name == "all" else report["rule"]["by_data_source"][name]
        line = f"{name[:32]:<32} {m['prompts']:>7} {m['accuracy']:>7.3f} {m['pass@1']:>7.3f}"
        line += "".join(f" {m[f'pass@{k}']:>8.3f}" for k in top_k) + f" {m[f'maj@{n}']:>7.3f}"
        if judged:
            c = report["combined"]["all"] if name == "all" else report["combined"]["by_data_source"][name]
            line += f" {c['accuracy']:>9.3f}"
        line += (f" {m['response_tokens_mean']:>7.1f} {m['truncated_rate']:>6.2f} {m['reward_timeouts']:>8} "
                 f"{m['errors']:>6}")
        lines.append(line)
    return "\n".join(lines)
