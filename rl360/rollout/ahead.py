"""The steps drawn ahead of the trainer (rollout.mode=async), kept in a checkpoint so a resumed run trains on them.

When checkpoint k is written in async mode, the rollouts of steps k+1 .. k+max_staleness are already under way,
drawn from weights older than step k's. A resumed run that drew them again would draw them from the checkpoint's
weights instead, and train on other samples than the unbroken run. So the checkpoint waits for them and keeps
them, scored, with the prompt stream's position after their prompts (`rollouts_ahead.pt`); the resumed run trains
on them first and draws the steps after them as the unbroken run does, from the weights it would have had.

    data, extra = keep_ahead(pending, sampler, step, cfg)          # when checkpoint `step` is written
    save_checkpoint(..., {"data": data, ...}, ..., extra=extra)
    pending, data, note = restore_ahead(checkpoint, cfg, state["data"])   # when resuming from it

The kept steps are used only while the settings that shape rollouts (`SHAPING`: seed, model, data, rollout,
reward, agent, algorithm and distill) are those they were drawn under; a resumed run that changes one draws them
again, from the stream position before them, and says so.
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import Any

from rl360.checkpointing import load_extra
from rl360.config import to_dict
from rl360.rollout.sampler import RolloutSampler, StepRollouts
from rl360.run_config import resume_changes

FILE = "rollouts_ahead.pt"
# the config sections rollouts depend on
SHAPING = ("seed", "model", "data", "rollout", "reward", "agent", "algorithm", "distill")


def keep_ahead(pending: dict[int, concurrent.futures.Future], sampler: RolloutSampler, step: int,
               cfg: Any) -> tuple[dict, dict[str, Any]]:
    """For checkpoint `step`: the stream position before step+1's prompts, and the checkpoint's extra files
    (none in sync mode): the steps under way (`pending`, step -> future of StepRollouts), waited for."""
    if not pending:
        return sampler.data_state(step + 1), {}
    steps = {upcoming: pending[upcoming].result() for upcoming in sorted(pending)}
    kept = {"steps": steps, "data_after": sampler.data_state(max(steps) + 1), "config": _shaping(cfg)}
    return steps[min(steps)].data_before, {FILE: kept}


def restore_ahead(checkpoint: Path, cfg: Any, data_before: dict
                  ) -> tuple[dict[int, concurrent.futures.Future], dict, str | None]:
    """Resuming from `checkpoint` (whose stream position before its next step is `data_before`): the kept steps
    as finished futures, the stream position to continue from, and a line saying what was restored (None when
    the checkpoint kept none)."""
    try:
        kept = load_extra(checkpoint, FILE)
    except Exception as err:  # written by another version of rl360, or damaged
        return {}, data_before, (f"resume: {checkpoint / FILE} cannot be read ({type(err).__name__}: {err}); "
                                 "the steps it kept are drawn again from the checkpoint's weights")
    if kept is None:
        return {}, data_before, None
    steps: dict[int, StepRollouts] = kept["steps"]
    shown = f"{min(steps)}-{max(steps)}" if len(steps) > 1 else str(min(steps))
    refused, allowed = resume_changes(kept["config"], _shaping(cfg))
    if refused or allowed:
        return {}, data_before, (f"resume: the rollouts of step {shown} kept in {checkpoint.name} are drawn again "
                                 f"from its weights ({'; '.join(refused + allowed)})")
    futures = {upcoming: _finished(rollouts) for upcoming, rollouts in steps.items()}
    return futures, kept["data_after"], f"resume: step {shown} trains on the rollouts drawn before {checkpoint.name}"


def _shaping(cfg: Any) -> dict[str, Any]:
    return {key: value for key, value in to_dict(cfg).items() if key in SHAPING}


def _finished(result: StepRollouts) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(result)
    return future
