"""The objective of one minibatch: what `Learner` minimises, given a forward pass and the
batch's advantages (the recipe's policy loss, entropy bonus, KL term and value loss). The
learner orders the passes, micro-batches and optimizer steps; this is the arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from rlhf_async.config import AlgoConfig
from rlhf_async.config.presets import Recipe
from rlhf_async.modeling.rollout import RolloutBatch
from rlhf_async.rl import algorithms as A
from rlhf_async.rl.guards import require_finite
from rlhf_async.rl.registry import POLICY_LOSSES, POLICY_STATS


@dataclass
class Forward:
    """One forward pass over a minibatch: the actor's log-probs of the response tokens,
    its entropy (a graph only for an entropy bonus) and the critic's values (None without
    a critic), each [b, R]."""

    logprobs: Tensor
    entropy: Tensor
    values: Tensor | None


@dataclass
class Objective:
    """The terms of the loss as this step sets them: the recipe, the knobs, the KL
    coefficient (moved by the adaptive controller) and the publish period (decoupled PPO's
    stale tokens)."""

    recipe: Recipe
    algo: AlgoConfig
    kl_coef: float
    publish_every: int

    def stat_names(self, has_critic: bool) -> list[str]:
        """The statistics `loss` returns, in the order every rank reduces them."""
        names = ["policy_loss", "entropy", *POLICY_STATS]
        names += ["kl_loss"] if self.recipe.kl_mode == "loss" else []
        return names + (["value_loss"] if has_critic else [])

    def loss(self, mb: RolloutBatch, fwd: Forward, adv: Tensor, ret: Tensor | None,
             old_lp: Tensor, old_v: Tensor | None, n_tokens: Tensor,
             n_seqs: Tensor) -> tuple[Tensor, Tensor | None, dict]:
        """-> actor loss, critic loss (already scaled by vf_coef; PPO only), stats, of the
        rows `mb` (their forward `fwd`, and their rows of advantages, returns, old
        log-probs and old values)."""
        algo, rc, lp = self.algo, self.recipe, fwd.logprobs
        m = mb.loss_mask
        weights = None if rc.mismatch == "none" else A.importance_weights(
            old_lp, mb.behaviour_logprobs, rc.mismatch_cap, rc.mismatch, m, rc.ratio_level)
        if rc.proximal and weights is None:  # (algo.mismatch's weights are pi_prox / mu too)
            stale = A.stale_tokens(mb.token_versions, mb.version, m,
                                   mb.step // self.publish_every)
            weights = A.proximal_weights(old_lp, mb.behaviour_logprobs, stale,
                                         rc.mismatch_cap, "tis", m, rc.ratio_level)
        pg, st = POLICY_LOSSES[rc.surrogate](
            lp, old_lp, adv, m, rc.clip_low, rc.clip_high, weights=weights,
            ratio_level=rc.ratio_level, loss_agg=rc.loss_agg, normaliser=n_tokens, n_seqs=n_seqs)
        if sorted(st) != sorted(POLICY_STATS):  # every rank reduces the same list of stats
            raise ValueError(f"policy loss {rc.surrogate!r} returned stats {sorted(st)}, not "
                             f"{list(POLICY_STATS)}")
        ent = A.masked_token_mean(fwd.entropy, m, n_tokens)
        loss = pg - algo.entropy_coef * ent if algo.entropy_coef > 0 else pg
        stats = {"policy_loss": pg.detach(), "entropy": ent.detach(), **st}
        if rc.kl_mode == "loss":
            assert mb.ref_logprobs is not None
            # per token, then aggregated as the policy term (GRPO's beta*KL inside its mean)
            kl = A.kl_per_token(lp, mb.ref_logprobs, rc.kl_estimator)
            kl_loss = A.aggregate(kl, m, rc.loss_agg, n_tokens, n_seqs)
            loss = loss + self.kl_coef * kl_loss
            stats["kl_loss"] = kl_loss.detach()
        if fwd.values is not None:
            assert old_v is not None and ret is not None
            vl = A.value_loss(fwd.values, old_v, ret, m, algo.value_clip, n_tokens)
            stats["value_loss"] = vl.detach()
            require_finite("the critic loss", vl, mb.step, "a reward or value out of range?")
            return loss, algo.vf_coef * vl, stats
        require_finite("the actor loss", loss, mb.step, "train.lr too high?")
        return loss, None, stats
