"""A step's rollouts as JSON lines (`trainer.dump_rollouts_every`): `<output_dir>/rollouts/step_000012.jsonl`, one
object per trajectory trained on, in the batch's order:

    {"index": 0, "data_source": "openai/gsm8k", "prompt": "...", "response": "...", "score": 1.0,
     "response_length": 57, "finish_reason": "stop", "weight_version": 11, "response_tokens": ["The", " answer", ...],
     "logprob_diff": [0.0012, null, ...], "logprob_diff_mean": 0.0009, "logprob_diff_max": 0.0031}

`response_tokens`: each response token's own text (decoded alone; `rl360 view` colours them by `logprob_diff`).
`logprob_diff`: per response token, |trainer log-prob - engine log-prob| (`old_logprobs` vs `rollout_logprobs`);
null on tokens not trained on (a tool's reply). A multi-turn trajectory adds `turns` (each span's text, whether
the engine generated it, the weight version) and `trajectory` (turn and tool-call counts, how it ended). A re-run
step (after a resume) writes its file again.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from rl360.core import Sample

ROLLOUT_DIR = "rollouts"


def due(every: int, step: int) -> bool:
    return every > 0 and step % every == 0


def dump_rollouts(output_dir: str | Path, step: int, samples: Sequence[Sample], rows: Sequence[dict],
                  scores: torch.Tensor, batch: Any, decode: Callable[[list[int]], str],
                  keep: torch.Tensor | None = None) -> Path:
    """Write the step's trajectories to `<output_dir>/rollouts/step_XXXXXX.jsonl` and return its path.

    `samples`, `rows`: the step's sampled trajectories and their prompts' rows; `keep` ([num samples] bool, None:
    all): those in `batch`, whose rows follow theirs with `scores`, `response_mask`, `rollout_logprobs` and
    `old_logprobs` (None before the trainer's log-probs: no difference written)."""
    kept = range(len(samples)) if keep is None else keep.nonzero().flatten().tolist()
    path = Path(output_dir) / ROLLOUT_DIR / f"step_{step:06d}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    diff = None
    if batch.old_logprobs is not None:
        diff = (batch.old_logprobs.float() - batch.rollout_logprobs.float()).abs().cpu()
    mask = batch.response_mask.cpu()
    lines = []
    for position, index in enumerate(kept):
        sample, row = samples[index], rows[index]
        record = {"index": position, "data_source": row.get("data_source", ""),
                  "prompt": decode(sample.prompt_ids), "response": decode(sample.response_ids),
                  "score": float(scores[position]), "response_length": len(sample.response_ids),
                  "finish_reason": sample.finish_reason, "weight_version": sample.weight_version,
                  "response_tokens": [decode([token]) for token in sample.response_ids]}
        if diff is not None:
            record.update(_logprob_diff(diff[position], mask[position], len(sample.response_ids)))
        if sample.turns is not None or hasattr(sample, "trace"):  # a multi-turn (agent) trajectory
            record["turns"] = [{"text": decode(sample.response_ids[turn.start:turn.end]), "generated": turn.generated,
                                "version": turn.version} for turn in sample.turn_list()]
            record["trajectory"] = {key: value for key, value in sample.summary(decode).as_dict().items()
                                    if key != "turn_texts"}
        lines.append(json.dumps(record, ensure_ascii=False) + "\n")
    partial = path.with_suffix(".jsonl.partial")
    partial.write_text("".join(lines), encoding="utf-8")
    os.replace(partial, path)
    return path


def _logprob_diff(diff: torch.Tensor, mask: torch.Tensor, length: int) -> dict[str, Any]:
    trained = mask[:length] > 0
    values = diff[:length]
    per_token = [float(value) if on else None for value, on in zip(values.tolist(), trained.tolist())]  # as computed
    chosen = values[trained]
    return {"logprob_diff": per_token,
            "logprob_diff_mean": float(chosen.mean()) if chosen.numel() else 0.0,
            "logprob_diff_max": float(chosen.max()) if chosen.numel() else 0.0}
