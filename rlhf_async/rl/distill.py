"""On-policy distillation's per-token term (GKD, arXiv:2306.13649; Thinking Machines 2025,
"On-Policy Distillation"): on a response the student sampled, each token's advantage is the
negative reverse KL to the teacher at that token, log pi_teacher(token) - log pi_student(token):
positive where the teacher likes the token more than the student did, negative where less.
The student's log-probs are the behaviour policy's (the generator's, as Tinker's cookbook),
so the term is known when the batch is scored and does not move during the update."""

from __future__ import annotations

import torch
from torch import Tensor

from rlhf_async.modeling.collectives import all_reduce_sum
from rlhf_async.modeling.rollout import RolloutBatch


def distill_advantages(teacher_logprobs: Tensor, student_logprobs: Tensor, mask: Tensor,
                       coef: float = 1.0) -> Tensor:
    """[B, R]: coef x (log pi_teacher - log pi_student) on the policy's tokens (mask 1),
    0 elsewhere (padding, an environment's tokens)."""
    return coef * (teacher_logprobs - student_logprobs) * mask


def reverse_kl_per_token(batch: RolloutBatch) -> float:
    """The mean over the global batch's policy tokens of log pi_student - log pi_teacher
    (the sampled estimate of the reverse KL that distillation drives to 0)."""
    assert batch.teacher_logprobs is not None
    m = batch.loss_mask
    kl = (batch.behaviour_logprobs - batch.teacher_logprobs) * m
    total = all_reduce_sum(torch.stack([kl.sum(), m.sum()]))
    return float(total[0] / total[1].clamp(min=1.0))
