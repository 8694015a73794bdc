"""`ood__livebench`: LiveBench's reasoning, language and data-analysis questions, scored by LiveBench's rules.

Rows as Reasoning360's `data_preprocess/ood/livebench.py` writes them: `extra_info["task"]` names the task
(LiveBench's `task` field), the ground truth is LiveBench's `ground_truth` string (tablejoin's may also be a
dict), `extra_info["prompt"]` holds the question's turns and `extra_info["date"]` its release date.

Tasks (one scorer each; their docstrings say what the answer is and how it is scored):
  data analysis  cta, tablejoin, tableformat (= LiveBench's tablereformat; needs `extra_info["prompt"]`)
  reasoning      web_of_lies_v2, web_of_lies_v3, house_traversal, zebra_puzzle, spatial
  language       plot_unscrambling, typos, connections
zebra_puzzle and connections changed answer format for questions released from 2024-11-25; the release date
picks the rule (see those scorers for rows without one).

Thinking up to the last </think> is dropped first. The result is {"score": s, "acc": s}, s in [0, 1]
(partial credit where LiveBench gives it: tablejoin, web_of_lies_v3, zebra_puzzle cells, plot_unscrambling,
connections). An unknown or missing task, or a ground truth the task cannot use, is a `ValueError`.

Where LiveBench's scorers have an accident, these follow the evident intent instead:
- tableformat: Reasoning360 calls LiveBench's scorer without the question (it always fails) and names the task
  "tableformat" while LiveBench's data says "tablereformat"; both names are accepted here, the question is
  read from `extra_info["prompt"]`, and tables are read without pandas (every column compared, see `tables`);
- web_of_lies_v2/v3: verdicts are read as words ("unknown" no longer counts as a "no"), case and bold aside;
- zebra_puzzle cells and house_traversal names match as whole words / in order with repeats ("1" is not
  found in "10"); connections from <solution> counts a repeated correct group once;
- typos and zebra read multi-line <solution> tags; a plot_unscrambling tie goes to the first sentence.
"""

from __future__ import annotations

from collections.abc import Callable

from rl360.rewards.livebench.data_analysis import cta_score, tablejoin_score, tablereformat_score
from rl360.rewards.livebench.language import connections_score, plot_unscrambling_score, typos_score
from rl360.rewards.livebench.reasoning import (
    house_traversal_score,
    spatial_score,
    web_of_lies_v2_score,
    web_of_lies_v3_score,
    zebra_puzzle_score,
)
from rl360.rewards.math import strip_thinking
from rl360.rewards.registry import register_reward

TaskScorer = Callable[[str, object, dict], float]

SCORERS: dict[str, TaskScorer] = {
    "cta": cta_score,
    "tablejoin": tablejoin_score,
    "tableformat": tablereformat_score,
    "tablereformat": tablereformat_score,
    "web_of_lies_v2": web_of_lies_v2_score,
    "web_of_lies_v3": web_of_lies_v3_score,
    "house_traversal": house_traversal_score,
    "zebra_puzzle": zebra_puzzle_score,
    "spatial": spatial_score,
    "plot_unscrambling": plot_unscrambling_score,
    "typos": typos_score,
    "connections": connections_score,
}


@register_reward("ood__livebench",
                 truth="LiveBench's ground_truth string for extra_info['task'] (tablejoin: a dict or its literal)",
                 answer="per task, as LiveBench's prompt asks: <solution> tags, **bold**, \\boxed{}, a table or "
                        "dict; partial credit where LiveBench gives it")
def livebench_score(solution_str: str, ground_truth, extra_info: dict | None = None) -> dict:
    """Score one LiveBench response with the scorer of `extra_info["task"]` (see the module doc)."""
    info = extra_info if isinstance(extra_info, dict) else {}
    task = info.get("task")
    if not isinstance(task, str) or task not in SCORERS:
        where = "missing from extra_info" if task is None else f"extra_info['task'] = {task!r} is unknown"
        raise ValueError(f"ood__livebench: task {where}; known tasks: {sorted(SCORERS)}")
    score = float(SCORERS[task](strip_thinking(solution_str), ground_truth, info))
    return {"score": score, "acc": score}
