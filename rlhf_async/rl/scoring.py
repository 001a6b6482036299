"""The scorer's role: rewards from the reward model (or the task's rule reward) and the
reference model's log-probs of each response."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from rlhf_async.modeling.models import ScalarHeadModel, response_logits, sequence_scores
from rlhf_async.modeling.rollout import RolloutBatch
from rlhf_async.rl import algorithms as A


@torch.no_grad()
def score(reward_model: ScalarHeadModel | None, reference: nn.Module, batch: RolloutBatch,
          temperature: float = 1.0,
          hidden_score: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None) -> RolloutBatch:
    """Add rewards [B] and reference log-probs [B, R] (and the hidden score [B]). The
    rewards are the reward model's scores; without a reward model, the hidden score is the
    reward (a task's rule reward)."""
    if reward_model is None and hidden_score is None:
        raise ValueError("score needs a reward model or a rule reward (hidden_score)")
    args = (batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask)
    logits = response_logits(reference, *args)
    ref_lp = A.gather_logprobs(logits, batch.response_ids, temperature) * batch.response_mask
    hidden = None
    if hidden_score is not None:
        hidden = hidden_score(batch.prompt_ids, batch.response_ids, batch.response_mask)
        hidden = hidden.to(ref_lp.device)
    if reward_model is None:
        assert hidden is not None  # checked above
        rewards = hidden.clone()
    else:
        rewards = sequence_scores(reward_model, *args).float()
    return batch.replace(rewards=rewards, ref_logprobs=ref_lp, hidden_scores=hidden)
