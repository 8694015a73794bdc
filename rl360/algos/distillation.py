"""On-policy distillation's advantage: the per-token reverse KL to a teacher, beside the task reward's.

The student samples a response y; a teacher scores each sampled token. With s_t = log p_student(y_t | y_<t) and
q_t = log p_teacher(y_t | y_<t), s_t - q_t is a one-sample estimate of the reverse KL, KL(student || teacher), at
position t, and the policy gradient that lowers it gives token t the advantage q_t - s_t (the teacher's log-prob
above the student's: reinforced; below: discouraged). Mixed with the advantage estimator's A_t (from the task
reward):

    A'_t = reward_weight * A_t + coef * (q_t - s_t)      on trained tokens (tool replies and padding: 0)
"""

from __future__ import annotations

import torch


def distill_advantages(advantages: torch.Tensor, teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor,
                       response_mask: torch.Tensor, coef: float, reward_weight: float
                       ) -> tuple[torch.Tensor, dict[str, float]]:
    """`[batch, response_len]` advantages with the reverse-KL term, and the step's distillation metrics (means over
    the trained tokens): `distill/reverse_kl` (mean s_t - q_t), `distill/teacher_logprob`,
    `distill/student_logprob`."""
    mask = response_mask
    gap = (student_logprobs - teacher_logprobs) * mask
    tokens = mask.sum().clamp(min=1)
    metrics = {"distill/reverse_kl": (gap.sum() / tokens).item(),
               "distill/teacher_logprob": ((teacher_logprobs * mask).sum() / tokens).item(),
               "distill/student_logprob": ((student_logprobs * mask).sum() / tokens).item()}
    return (reward_weight * advantages - coef * gap) * mask, metrics
