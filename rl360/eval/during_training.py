"""Evaluation during training: the held-out prompts of `data.val_files`, sampled by the run's own engine fleet
between steps (`RolloutSampler.evaluate`: the agent loop too, where one is set) and scored by the run's reward
pool, summarised per data_source and overall with `rl360.eval.metrics.summarize`.

    evaluation = TrainingEval(cfg.validation, cfg.data, cfg.rollout, cfg.seed, cfg.trainer.total_steps,
                              renderer, sampler)  # reads and checks data.val_files once
    metrics = evaluation.at(step)  # {} unless `step` is due; else eval/<data_source>/<metric>, eval/all/<metric>

A step is due when it is a multiple of `validation.every`, or the last step with `validation.at_end`; step 0
(the starting weights) is evaluated with `validation.before_train`, by a run that starts, not one that resumes.
Due steps are a function of the step alone, so a resumed run evaluates at the steps an unbroken run does. Every
evaluation draws with the same seeds (sample j of held-out prompt i seeded `seed + 104729 + i * n + j`), so two
steps' numbers differ by the policy, not by the draw. The `validation` section sets the schedule, the sampling
(n, temperature 0: greedy, top_p, top_k, max_response_length) and the k of pass@k.

Metrics per data_source and `all`: prompts, samples, accuracy (the mean score), pass@k, maj@n, response_tokens_mean
/ _max / _median, truncated_rate, reward_timeouts, errors; and timing/eval_s.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import replace
from typing import Any

import pyarrow.parquet as pq

from rl360.data import DataError, PromptStream, expand_paths
from rl360.eval.config import ks_for
from rl360.eval.metrics import SampleOutcome, summarize
from rl360.rewards.judge import stated_answer
from rl360.rollout.sampler import RolloutSampler, SampledScores

SEED_OFFSET = 104_729  # held-out seeds apart from the training steps' (cfg.seed * 1_000_003 + step + ...)


def evaluates(validation: Any) -> bool:
    """Whether the run evaluates held-out prompts at all (its `validation` section)."""
    return bool(validation.every or validation.before_train or validation.at_end)


class TrainingEval:
    def __init__(self, validation: Any, data: Any, rollout: Any, seed: int, total_steps: int, renderer: Any,
                 sampler: RolloutSampler):
        """From the run's `validation`, `data` (val_files, on_bad_row) and `rollout` sections, its seed and its
        number of steps."""
        self.validation, self.seed, self.total_steps, self.sampler = validation, seed, total_steps, sampler
        self.rows = held_out_rows(data.val_files, renderer, data.on_bad_row) if evaluates(validation) else []
        v = validation
        self.rollout = replace(rollout, n=v.n, temperature=v.temperature, top_p=v.top_p, top_k=v.top_k,
                               max_response_length=v.max_response_length or rollout.max_response_length)
        self.ks = ks_for(v.n, v.pass_k)

    def due(self, step: int) -> bool:
        v = self.validation
        return evaluates(v) and (bool(v.every) and step % v.every == 0 or v.at_end and step == self.total_steps)

    def at(self, step: int) -> dict[str, float]:
        """The held-out metrics at `step` when it is due (the engines hold its weights), else {}."""
        return self.run(step) if self.due(step) else {}

    def run(self, step: int) -> dict[str, float]:
        started = time.perf_counter()
        sampled = self.sampler.evaluate(self.rows, self.rollout, self.seed + SEED_OFFSET)
        metrics = eval_metrics(sampled, self.rollout.n, self.ks)
        metrics["timing/eval_s"] = time.perf_counter() - started
        shown = "  ".join(f"{key}={metrics[f'eval/all/{key}']:.4g}" for key in ("accuracy", f"pass@{self.ks[-1]}",
                                                                                  "response_tokens_mean"))
        print(f"eval at step {step}: {len(self.rows)} held-out prompts x {self.rollout.n}  {shown}  "
              f"({metrics['timing/eval_s']:.1f} s)", flush=True)
        return metrics


def eval_metrics(sampled: SampledScores, n: int, ks: list[int]) -> dict[str, float]:
    """`eval/<data_source>/<metric>` and `eval/all/<metric>` of scored samples, `n` consecutive per prompt."""
    outcomes = [SampleOutcome(result.score, stated_answer(text) or None, len(sample.response_ids),
                              sample.status == "truncated", result.timed_out,
                              result.error is not None and not result.timed_out)
                for sample, text, result in zip(sampled.samples, sampled.texts, sampled.results)]
    groups = [outcomes[i:i + n] for i in range(0, len(outcomes), n)]
    by_source: dict[str, list[list[SampleOutcome]]] = defaultdict(list)
    for group, row in zip(groups, sampled.rows[::n]):
        by_source[row["data_source"]].append(group)
    return {f"eval/{name}/{key}": value
            for name, named in [("all", groups), *sorted(by_source.items())]
            for key, value in summarize(named, ks).items()}


def held_out_rows(files: list[str], renderer: Any, on_bad_row: str) -> list[dict]:
    """Every row of `files` in order, checked as training rows are (a bad row raises, or is skipped with
    data.on_bad_row=skip; prompts over data.max_prompt_length are left out, and counted in a line)."""
    paths = expand_paths(files)
    total = sum(pq.ParquetFile(path).metadata.num_rows for path in paths)
    stream = PromptStream(paths, max(total, 1), shuffle=False, on_bad_row=on_bad_row, drop_last=False,
                          filter_fn=renderer.fits)
    try:
        rows = next(stream)
    except DataError as err:
        if "gave dp rank" not in str(err):
            raise
        raise DataError(f"data.val_files {files}: none of their {total} rows is a good prompt of at most "
                        "data.max_prompt_length tokens") from None
    finally:
        stream.close()
    skipped = stream.skipped()
    if skipped["bad_rows"] or skipped["filtered"]:
        print(f"eval: {len(rows)} of {total} held-out rows evaluated ({skipped['filtered']} over "
              f"data.max_prompt_length, {skipped['bad_rows']} bad rows skipped)", flush=True)
    return rows
