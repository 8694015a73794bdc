"""Evaluation during training: the held-out prompts of `data.val_files`, sampled between steps through `rl360
eval`'s runner on the run's own sampler (`SamplerTarget`: the run's engines, its agent loop where one is set, its
renderer) and scored by the run's reward pool, reported as `rl360 eval` reports (`rl360.eval.scoring`).

    evaluation = TrainingEval(cfg.validation, cfg.data, cfg.rollout, cfg.seed, cfg.trainer.total_steps,
                              renderer, sampler, output_dir)  # reads and checks data.val_files once
    metrics = evaluation.at(step)  # {} unless `step` is due; else eval/<data_source>/<metric>, eval/all/<metric>

A step is due when it is a multiple of `validation.every`, or the last step with `validation.at_end`; step 0
(the starting weights) is evaluated with `validation.before_train`, by a run that starts, not one that resumes.
Due steps are a function of the step alone, so a resumed run evaluates at the steps an unbroken run does. Every
evaluation draws with the same seeds (sample j of held-out prompt i seeded `seed + 104729 + i * n + j`), so two
steps' numbers differ by the policy, not by the draw. The `validation` section sets the schedule, the sampling
(n, temperature 0: greedy, top_p, top_k, max_response_length) and the k of pass@k.

Each evaluation writes `<output_dir>/eval/step_NNNNNN/`: `results.jsonl` (every sample's response, finish reason,
tokens, seed and, for an agent's trajectory, its turns and tool calls), `report.json`, `errors.jsonl` (the samples
scored below 1) and `eval_run.json` naming `<output_dir>/eval/prompts.jsonl` (the held-out prompts), so that
`rl360 view <output_dir>/eval/step_NNNNNN` browses it as an `rl360 eval` output. A step evaluated again (a run
resumed from an earlier checkpoint) replaces its directory.

Metrics per data_source and `all`: prompts, samples, accuracy (the mean score), pass@k, maj@n, response_tokens_mean
/ _max / _median, truncated_rate, reward_timeouts, errors; and timing/eval_s.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from rl360.data import DataError, PromptStream, expand_paths
from rl360.data.schema import extra_info_dict
from rl360.eval.config import ks_for
from rl360.eval.inputs import EvalPrompt
from rl360.eval.runner import RESULTS, RUN_FILE, Dispatcher, DispatchSettings, read_results
from rl360.eval.scoring import build_report, score_samples, write_report
from rl360.eval.targets import SamplerTarget
from rl360.rollout.sampler import RolloutSampler

SEED_OFFSET = 104_729  # held-out seeds apart from the training steps' (cfg.seed * 1_000_003 + step + ...)
PROMPTS = "prompts.jsonl"
PROGRESS_EVERY_S = 60.0  # a progress line of a long evaluation
IN_FLIGHT_PER_ENGINE = 256  # samples requested at once per engine (its client's connections); the rest wait their turn


def evaluates(validation: Any) -> bool:
    """Whether the run evaluates held-out prompts at all (its `validation` section)."""
    return bool(validation.every or validation.before_train or validation.at_end)


class TrainingEval:
    def __init__(self, validation: Any, data: Any, rollout: Any, seed: int, total_steps: int, renderer: Any,
                 sampler: RolloutSampler, output_dir: str | Path):
        """From the run's `validation`, `data` (val_files, on_bad_row) and `rollout` sections, its seed, its
        number of steps and its output directory."""
        self.validation, self.total_steps, self.sampler = validation, total_steps, sampler
        self.out = Path(output_dir) / "eval"
        rows = held_out_rows(data.val_files, renderer, data.on_bad_row) if evaluates(validation) else []
        self.prompts = [held_out_prompt(index, row) for index, row in enumerate(rows)]
        v = validation
        self.rollout = replace(rollout, n=v.n, temperature=v.temperature, top_p=v.top_p, top_k=v.top_k,
                               max_response_length=v.max_response_length or rollout.max_response_length)
        self.ks = ks_for(v.n, v.pass_k)
        self.dispatch = DispatchSettings(v.n, seed + SEED_OFFSET, max_retries=0, retry_rounds=0,
                                         progress_every_s=PROGRESS_EVERY_S, final_line=False)
        if self.prompts:
            write_prompts(self.out / PROMPTS, self.prompts)

    def due(self, step: int) -> bool:
        v = self.validation
        return evaluates(v) and (bool(v.every) and step % v.every == 0 or v.at_end and step == self.total_steps)

    def at(self, step: int) -> dict[str, float]:
        """The held-out metrics at `step` when it is due (the engines hold its weights), else {}."""
        return self.run(step) if self.due(step) else {}

    def run(self, step: int) -> dict[str, float]:
        """Every held-out sample drawn on the engines as they are, scored and reported in the step's directory;
        the report's numbers as metrics."""
        started = time.perf_counter()
        n, out = self.rollout.n, self.out / f"step_{step:06d}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        (out / RUN_FILE).write_text(json.dumps(self.identity(step), indent=1))
        target = SamplerTarget(self.sampler, self.rollout,
                               min(len(self.prompts) * n, IN_FLIGHT_PER_ENGINE * self.rollout.num_engines))
        self.sampler.run(Dispatcher(self.dispatch, [target], self.prompts, out).run({}))
        groups = score_samples(self.prompts, read_results(out / RESULTS, len(self.prompts), n), n,
                               self.sampler.score)
        report = build_report(n, self.ks, groups, judged=False)
        write_report(out, report, groups)
        metrics = report_metrics(report)
        metrics["timing/eval_s"] = time.perf_counter() - started
        shown = "  ".join(f"{key}={metrics[f'eval/all/{key}']:.4g}" for key in ("accuracy", f"pass@{self.ks[-1]}",
                                                                                  "response_tokens_mean"))
        print(f"eval at step {step}: {len(self.prompts)} held-out prompts x {n}  {shown}  "
              f"({metrics['timing/eval_s']:.1f} s, samples in {out})", flush=True)
        return metrics

    def identity(self, step: int) -> dict[str, Any]:
        """The step directory's `eval_run.json`: its prompts file and sampling, as an `rl360 eval` run's."""
        r = self.rollout
        return {"files": [str((self.out / PROMPTS).resolve())], "prompt_field": "", "max_prompts": 0, "n": r.n,
                "seed": self.dispatch.seed, "step": step,
                "sampling": {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k,
                             "max_tokens": r.max_response_length, "stop": list(r.stop)}}


def report_metrics(report: dict[str, Any]) -> dict[str, float]:
    """A report's rule numbers as `eval/all/<metric>` and `eval/<data_source>/<metric>`."""
    rule = report["rule"]
    return {f"eval/{name}/{key}": value
            for name, numbers in [("all", rule["all"]), *sorted(rule["by_data_source"].items())]
            for key, value in numbers.items()}


def held_out_prompt(index: int, row: dict) -> EvalPrompt:
    """A held-out row as the runner's prompt; its reward gets the row's ground truth and extra_info as in training."""
    return EvalPrompt(index, list(row["prompt"]), row["data_source"], row["reward_model"]["ground_truth"],
                      row.get("extra_info"), row=row)


def write_prompts(path: Path, prompts: list[EvalPrompt]) -> None:
    """The held-out prompts as `rl360 eval` reads jsonl prompts (messages, data_source, ground truth, extra_info;
    images are not written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as out:
        for p in prompts:
            out.write(json.dumps({"messages": p.messages, "data_source": p.data_source,
                                  "ground_truth": p.ground_truth, "extra_info": extra_info_dict(p.extra_info)},
                                 default=str) + "\n")
    tmp.replace(path)


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
