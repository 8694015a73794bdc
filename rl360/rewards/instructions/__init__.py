"""Instruction-following rewards: IFEval's and IFBench's verifiable instructions and their scorers.

`text` holds the shared word/sentence/paragraph utilities, `ifeval` IFEval's 25 checks (`IFEVAL_CHECKS`),
`ifbench` IFBench's (`IFBENCH_CHECKS`), and `score` the reward registered for "ood__ifeval" and
"ood__ifbench".
"""

from rl360.rewards.instructions.score import (
    INSTRUCTION_CHECKS,
    instruction_reward,
    parse_instructions,
    score_instructions,
)

__all__ = ["INSTRUCTION_CHECKS", "instruction_reward", "parse_instructions", "score_instructions"]
