"""Routes for data_source names of Reasoning360 that are scored by a function defined in another module.

- `stem__gpqa*` and `stem__supergpqa*`: multiple choice, `rl360.rewards.stem:stem_score`. Reasoning360 picks
  its reader by name (`stem__gpqa*` with "no_box" in the name reads "Answer: X"; the others read the last
  \\boxed{} or "Final Answer:"); `stem_score` reads every one of those forms for every name, so one route
  serves both. The names are registered here, more specific than `stem*`, so that the docs list them.
- `ordering_puzzle_dataset` (exactly): the data_source Reasoning360's puzzle generator
  (`data_preprocess/logic/puzzle_gen.py`) writes by default, before its postprocessing prefixes `logic__`.
  Reasoning360 scores it with its ordering-puzzle scorer (the list in the last <answer>, items compared
  lower-cased, 1 for the exact order, else 0), which is `rl360.rewards.logic:ordering_score`'s rule.
"""

from __future__ import annotations

from rl360.rewards.registry import register_reward_path

_LETTER_TRUTH = "one option letter A-J, e.g. \"C\""
_LETTER_ANSWER = ("the option letter chosen: last \\boxed{}, \"Answer: $C$\", \"Final Answer: ... B\" "
                  "(after any </think>; gpqa *no_box* names too)")

for _name in ("stem__gpqa", "stem__supergpqa"):
    register_reward_path(_name, "rl360.rewards.stem:stem_score", truth=_LETTER_TRUTH, answer=_LETTER_ANSWER)

register_reward_path("ordering_puzzle_dataset", "rl360.rewards.logic:ordering_score", exact=True,
                     truth="the ordered list (JSON, a Python literal or a list)",
                     answer="the list in the last <answer>, as for logic__ordering*; exact order only")
