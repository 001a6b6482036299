"""Advantages of a scored batch, per the algorithm's recipe (`config/presets.py`).

Where the KL penalty to the reference goes (`algo.kl_mode`): "reward" subtracts kl_coef x
the per-token KL from the reward (InstructGPT, PPO's default), per token for per-token
baselines (GAE, REINFORCE++'s returns to go) and as the response's sum for group
baselines; "loss" leaves the advantages to the task reward and adds the KL term to the loss
(`Learner._loss`, aggregated like the policy term). With a group baseline the group's
statistics come from the task reward alone: the KL penalty gets the same baseline but is
never divided by the group's std, so a group of equal rewards is not trained on KL noise
amplified by 1/std.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhf_async.config import AlgoConfig
from rlhf_async.config.presets import Recipe
from rlhf_async.modeling.collectives import all_reduce_sum
from rlhf_async.modeling.rollout import RolloutBatch
from rlhf_async.rl import algorithms as A
from rlhf_async.rl.guards import require_finite


@torch.no_grad()
def advantages(b: RolloutBatch, old_lp: Tensor | None, values: Tensor | None,
               algo: AlgoConfig, rc: Recipe, kl_coef: float,
               ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """-> advantages [B, R], returns [B, R] (PPO only), per-token KL [B, R] (None
    without `old_lp`: then the rewards alone decide, `Learner._reuses_logprobs`)."""
    m = b.loss_mask
    assert b.rewards is not None and b.ref_logprobs is not None  # checked by train_step
    kl = None if old_lp is None else A.kl_per_token(
        old_lp, b.ref_logprobs, algo.kl_estimator) * m
    kl_r = kl_coef if algo.kl_mode == "reward" and kl is not None else 0.0
    ret = None
    if rc.baseline in ("gae", "none"):  # per token: the KL still to come, per token
        r = A.token_rewards(b.rewards, m.new_zeros(m.shape) if kl is None else kl, m, kl_r)
        if rc.baseline == "gae":
            assert values is not None  # PPO always has a critic
            adv, ret = A.gae(r, values, m, algo.gamma, algo.lam)
        else:  # REINFORCE++: returns to go, no discount, no critic
            adv, _ = A.gae(r, m.new_zeros(m.shape), m, 1.0, 1.0)
    else:
        # group statistics from the task reward alone: the KL penalty (same baseline,
        # never divided by the std) is not amplified into a signal in an equal group
        adv = A.outcome_advantages(b.rewards, b.group_ids, rc.baseline,
                                   rc.adv_norm == "group")  # [B]
        if kl is not None and kl_r:
            adv = adv - kl_r * A.outcome_advantages(kl.sum(dim=1), b.group_ids,
                                                    rc.baseline, False)
        adv = adv[:, None] * m
    if rc.adv_norm == "batch":
        adv = A.whiten(adv, m, all_reduce_sum)
    require_finite("an advantage", adv, b.step, "a reward or value out of range?",
                   b.sample_ids)
    return adv, ret, kl
