"""The algorithm's two extension points, each a registry from a name to a function with a
written contract: advantage estimators (`ADVANTAGE_ESTIMATORS`, the `Recipe.baseline` an
`algo.name` preset names or `algo.advantage_estimator` sets) and policy losses
(`POLICY_LOSSES`, the `Recipe.surrogate` a preset names or `algo.policy_loss` sets).
`Learner` dispatches through them; a new one is a function and one line:

    ADVANTAGE_ESTIMATORS["mine"] = my_estimator   # then algo.advantage_estimator = "mine"
    POLICY_LOSSES["mine"] = my_loss               # then algo.policy_loss = "mine"

These dicts are the one list of accepted names: the config layer sits below rl/ and
cannot see them, so it takes any string and `name_problems` checks it where they are
reachable (`prepare_run` before a job does any work, and `Learner`). A name registered at
run time exists in the process that registered it: a job run from Python (`job.run`)
whose training runs in that process (a lock-step strategy on one device).

What varies around them stays a knob of the `Recipe`: the advantage's normalisation
(`adv_norm`: group is the estimator's, batch is applied after it), the ratio's level
(`ratio_level`: GSPO's sequence ratio for any loss), the loss aggregation (`loss_agg`) and
the importance weights (mismatch, decoupled PPO), each passed to the loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from rlhf_async.config.presets import Recipe
from rlhf_async.rl import algorithms as A

POLICY_STATS = ("clip_frac", "approx_kl")  # what every policy loss reports


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator may use, for this rank's shard of the global batch (B rows of R
    response tokens). Tensors on the trainer's device; detached (no graph)."""

    scores: Tensor  # [B] each response's reward (the task's; KL not subtracted)
    mask: Tensor  # [B, R] 1 on the tokens the policy is trained on
    kl: Tensor | None  # [B, R] per-token KL to the reference, 0 off the mask; None: not
    # computed (no old log-probs: `Learner._reuses_logprobs`, then kl_coef is 0 too)
    kl_coef: float  # the KL's weight in the reward (0 unless `Recipe.kl_mode` = reward)
    values: Tensor | None  # [B, R] the critic's values (only with a critic: baseline gae)
    group_ids: Tensor  # [B] responses to the same prompt share an id
    sample_ids: Tensor  # [B] each response's id (an agent's earlier segments repeat it)
    episode_segments: Tensor | None  # [B] 0 on an agent episode's earlier segments
    group_norm: bool  # `Recipe.adv_norm` = group: divide by the group's score std
    gamma: float  # `algo.gamma` (GAE's discount)
    lam: float  # `algo.lam` (GAE's lambda)


class AdvantageEstimator(Protocol):
    """inputs -> (advantages [B, R], returns [B, R] or None). Advantages are 0 off the mask;
    returns are the critic's targets (None without a critic). Batch normalisation (`adv_norm`
    = batch) and the distillation term are applied by the learner afterwards; under
    torch.distributed the shard's statistics are its own (group ids stay on one rank)."""

    def __call__(self, x: AdvantageInputs, /) -> tuple[Tensor, Tensor | None]: ...


class PolicyLoss(Protocol):
    """(logprobs, old_logprobs, advantages, mask [b, R] each; clip_low, clip_high) -> (loss,
    stats). logprobs carry the graph; `weights` [b, R] multiply each token's term (mismatch or
    staleness correction; None = 1); `ratio_level` token | sequence; `loss_agg` as
    `algorithms.aggregate`; `normaliser`, `n_seqs`: the minibatch's GLOBAL token and response
    counts (so gradients summed over micro-batches and ranks are the minibatch's). The loss
    is a scalar; stats are detached scalars with exactly the keys `POLICY_STATS`, each a
    share of a minibatch-global mean (summed over micro-batches by the learner)."""

    def __call__(self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                 mask: Tensor, clip_low: float, clip_high: float, /, *,
                 weights: Tensor | None = None, ratio_level: str = "token",
                 loss_agg: str = "token_mean", normaliser: Tensor | float | None = None,
                 n_seqs: Tensor | float | None = None) -> tuple[Tensor, dict[str, Tensor]]: ...


def _token_rewards(x: AdvantageInputs) -> Tensor:
    """[B, R]: the score on the last token, minus kl_coef x the KL on every token."""
    kl = x.mask.new_zeros(x.mask.shape) if x.kl is None else x.kl
    return A.token_rewards(x.scores, kl, x.mask, x.kl_coef)


def gae(x: AdvantageInputs) -> tuple[Tensor, Tensor | None]:
    """PPO: GAE over per-token rewards with the critic's values."""
    if x.values is None:
        raise ValueError("the gae advantage estimator needs a critic's values")
    return A.gae(_token_rewards(x), x.values, x.mask, x.gamma, x.lam)


def returns_to_go(x: AdvantageInputs) -> tuple[Tensor, Tensor | None]:
    """REINFORCE++ (baseline none): each token's reward to go (the KL still to come), no
    discount, no critic."""
    adv, _ = A.gae(_token_rewards(x), x.mask.new_zeros(x.mask.shape), x.mask, 1.0, 1.0)
    return adv, None


def _outcome(x: AdvantageInputs, baseline: str) -> Tensor:
    penalty = None if x.kl is None else x.kl_coef * x.kl.sum(dim=1)  # [B]
    adv = A.episode_advantages(x.scores, x.group_ids, x.sample_ids, x.episode_segments,
                               baseline, x.group_norm, penalty)
    return adv[:, None] * x.mask


def group_mean(x: AdvantageInputs) -> tuple[Tensor, Tensor | None]:
    """GRPO and its descendants: the score minus its group's mean (over the std with
    group_norm), on every token of the response."""
    return _outcome(x, "group_mean"), None


def leave_one_out(x: AdvantageInputs) -> tuple[Tensor, Tensor | None]:
    """RLOO: the score minus the mean of the other responses to the same prompt."""
    return _outcome(x, "leave_one_out"), None


def no_reward(x: AdvantageInputs) -> tuple[Tensor, Tensor | None]:
    """On-policy distillation: no reward term (the teacher's per-token term, added by the
    learner, is all of the advantage)."""
    return x.mask.new_zeros(x.mask.shape), None


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "gae": gae, "none": returns_to_go, "group_mean": group_mean,
    "leave_one_out": leave_one_out, "distill": no_reward}

POLICY_LOSSES: dict[str, PolicyLoss] = {
    "clip": A.ppo_policy_loss,  # PPO's clipped ratio (GSPO: with ratio_level = sequence)
    "cispo": A.cispo_policy_loss}  # CISPO's clipped, stop-gradient importance weight


def name_problems(recipe: Recipe) -> list[str]:
    """The recipe's estimator and loss names missing from the registries, each as a config
    problem listing the accepted names."""
    out = []
    if recipe.baseline not in ADVANTAGE_ESTIMATORS:
        out.append(f"algo.advantage_estimator: unknown {recipe.baseline!r}; accepted: "
                   f"{', '.join(sorted(ADVANTAGE_ESTIMATORS))} (or '' = the preset's)")
    if recipe.surrogate not in POLICY_LOSSES:
        out.append(f"algo.policy_loss: unknown {recipe.surrogate!r}; accepted: "
                   f"{', '.join(sorted(POLICY_LOSSES))} (or '' = the preset's)")
    return out
