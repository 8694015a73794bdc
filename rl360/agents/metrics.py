"""Metrics of a batch of agent trajectories, for the step's log."""

from __future__ import annotations

from collections import Counter

from rl360.agents.loop import AgentSample


def agent_metrics(samples: list[AgentSample]) -> dict[str, float]:
    """`agent/turns` and `agent/tool_calls` (mean, max), per-tool calls and errors, errors, timeouts, time in
    tools, the share of trajectories that hit max_turns or the token budget, generated vs tool tokens (mean per
    trajectory, and the tool share of all response tokens), and `agent/cut_turns`: turns cut by a weight update
    (`rollout.partial`) or a failed engine and continued (each counted once; the step's `rollout/aborted` counts
    the trajectories with one, `rollout/resumed` the continuations). Empty for no samples."""
    if not samples:
        return {}
    count = len(samples)
    turns = [len(sample.trace.turns) for sample in samples]
    calls = [len(sample.trace.calls) for sample in samples]
    per_tool, per_tool_errors = Counter(), Counter()
    errors = timeouts = 0
    seconds = 0.0
    generated = tool = 0
    for sample in samples:
        mask = sample.mask()
        generated += sum(mask)
        tool += len(mask) - sum(mask)
        for turn in sample.trace.turns:
            seconds += turn.tool_seconds
        for call in sample.trace.calls:
            per_tool[call.name] += 1
            if call.error or call.timed_out:
                errors += 1
                per_tool_errors[call.name] += 1
            timeouts += call.timed_out
    metrics = {
        "agent/turns/mean": sum(turns) / count, "agent/turns/max": float(max(turns)),
        "agent/tool_calls/mean": sum(calls) / count, "agent/tool_calls/max": float(max(calls)),
        "agent/tool_errors": float(errors), "agent/tool_timeouts": float(timeouts),
        "agent/tool_error_rate": errors / max(sum(calls), 1),
        "agent/tool_seconds/mean": seconds / count,
        "agent/hit_max_turns": sum(sample.trace.ended_by == "max_turns" for sample in samples) / count,
        "agent/hit_budget": sum(sample.trace.ended_by in ("budget", "length") for sample in samples) / count,
        "agent/generated_tokens/mean": generated / count, "agent/tool_tokens/mean": tool / count,
        "agent/tool_token_share": tool / max(generated + tool, 1),
        "agent/images_dropped": float(sum(sample.trace.images_dropped for sample in samples)),
        "agent/cut_turns": float(sum(turn.resumed > 0 for sample in samples for turn in sample.trace.turns)),
    }
    for name in sorted(per_tool):
        metrics[f"agent/calls/{name}"] = float(per_tool[name])
        metrics[f"agent/errors/{name}"] = float(per_tool_errors[name])
    return metrics
