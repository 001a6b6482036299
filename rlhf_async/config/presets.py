"""`algo.name` presets: each algorithm is a set of values for orthogonal knobs that a user
can also set alone (`algo.loss_agg`, `algo.adv_norm`, ...). A knob left at its "preset's"
value ('' for a choice, 0 for a clip, -1 for the overlong penalty) takes the preset's; an
explicit value wins. `resolve` turns an `AlgoConfig` into the concrete `Recipe` the learner
and the reward mix read, so the preset table lives here only.

The advantage's baseline is the preset's alone (it is what names an algorithm):
gae (PPO's critic), group_mean (GRPO and its descendants), leave_one_out (RLOO), none
(REINFORCE++: the reward minus the KL still to come, normalised over the batch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlhf_async.config.schema import AlgoConfig

BASELINES = ("gae", "group_mean", "leave_one_out", "none")
DAPO_OVERLONG_FRACTION = 0.2  # DAPO's buffer: 4096 of 20480 tokens


@dataclass(frozen=True)
class Recipe:
    """Concrete values of every algorithm knob (nothing left to a preset)."""

    baseline: str
    adv_norm: str  # group | batch | none
    loss_agg: str  # token_mean | seq_mean_token_sum | seq_mean_token_mean
    ratio_level: str  # token | sequence
    clip_low: float
    clip_high: float
    overlong_penalty: float  # the reward's penalty at max_new_tokens; 0 = off
    mismatch: str  # none | tis | mis
    mismatch_cap: float

    @property
    def has_critic(self) -> bool:
        return self.baseline == "gae"

    @property
    def needs_groups(self) -> bool:
        """Whether the advantages compare responses to the same prompt."""
        return self.baseline in ("group_mean", "leave_one_out") or self.adv_norm == "group"


def ppo(a: AlgoConfig) -> dict[str, Any]:
    """PPO with a critic and GAE (Schulman et al. 2017, arXiv:1707.06347; RLHF as in
    Ziegler et al. 2019, arXiv:1909.08593): advantages whitened over the global batch
    (`algo.whiten_advantages = false`: not normalised)."""
    return {"baseline": "gae", "adv_norm": "batch" if a.whiten_advantages else "none"}


def grpo(a: AlgoConfig) -> dict[str, Any]:
    """GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300): no critic; a response's
    advantage is its reward minus its group's mean, over the group's std."""
    return {"baseline": "group_mean", "adv_norm": "group"}


def rloo(a: AlgoConfig) -> dict[str, Any]:
    """RLOO (Ahmadian et al. 2024, arXiv:2402.14740): the reward minus the mean of the
    other responses to the same prompt, not normalised."""
    return {"baseline": "leave_one_out", "adv_norm": "none"}


def dapo(a: AlgoConfig) -> dict[str, Any]:
    """DAPO (Yu et al. 2025, arXiv:2503.14476): GRPO's advantages with clip-higher
    (eps_low 0.2, eps_high 0.28), the token-mean loss over the whole batch, and the soft
    overlong penalty on the reward (a linear ramp to -1 over the last fifth of
    `max_new_tokens`). Dynamic sampling, its fourth part, is not a knob of this preset.
    The paper also drops the KL term; here the KL keys keep the job's values (the
    built-in task's reward model is exploited without them): `algo.kl_coef = 0
    algo.kl_target = 0` drops it."""
    return {"baseline": "group_mean", "adv_norm": "group", "loss_agg": "token_mean",
            "clip_low": 0.2, "clip_high": 0.28, "overlong_penalty": 1.0}


def gspo(a: AlgoConfig) -> dict[str, Any]:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071): GRPO's advantages with the sequence's
    length-normalised likelihood ratio (exp of the mean per-token log ratio), clipped per
    sequence in a narrow range (3e-4 below, 4e-4 above), the loss a mean over sequences."""
    return {"baseline": "group_mean", "adv_norm": "group", "ratio_level": "sequence",
            "loss_agg": "seq_mean_token_mean", "clip_low": 3e-4, "clip_high": 4e-4}


def dr_grpo(a: AlgoConfig) -> dict[str, Any]:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
    Perspective", arXiv:2503.20783): GRPO without its two biases: the advantage is not
    divided by the group's std, and the loss is not divided by each response's length
    (token sums, averaged over sequences)."""
    return {"baseline": "group_mean", "adv_norm": "none", "loss_agg": "seq_mean_token_sum"}


def reinforce_pp(a: AlgoConfig) -> dict[str, Any]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): no critic and no per-prompt baseline; a
    token's advantage is the reward minus the KL penalty of it and the tokens after it,
    normalised (z-score) over every token of the global batch."""
    return {"baseline": "none", "adv_norm": "batch"}


PRESETS: dict[str, Callable[[AlgoConfig], dict[str, Any]]] = {
    f.__name__: f for f in (ppo, grpo, rloo, dapo, gspo, dr_grpo, reinforce_pp)}


def resolve(a: AlgoConfig) -> Recipe:
    """The concrete knobs of `a`: its explicit values, else its preset's, else the plain
    ones (token-level ratio, token-mean loss, the symmetric `clip_eps`, no penalty).
    `algo.is_cap` (the older name) is TIS with that cap."""
    p = PRESETS[a.name](a)
    mismatch, cap = a.mismatch, a.mismatch_cap
    if mismatch == "none" and a.is_cap > 0:
        mismatch, cap = "tis", a.is_cap
    return Recipe(
        baseline=p["baseline"], adv_norm=a.adv_norm or p["adv_norm"],
        loss_agg=a.loss_agg or p.get("loss_agg", "token_mean"),
        ratio_level=a.ratio_level or p.get("ratio_level", "token"),
        clip_low=a.clip_eps_low or p.get("clip_low", a.clip_eps),
        clip_high=a.clip_eps_high or p.get("clip_high", a.clip_eps),
        overlong_penalty=(a.overlong_penalty if a.overlong_penalty >= 0
                          else p.get("overlong_penalty", 0.0)),
        mismatch=mismatch, mismatch_cap=cap)


def overlong_buffer(a: AlgoConfig, max_new_tokens: int) -> int:
    """Tokens before `max_new_tokens` over which the overlong penalty ramps up:
    `algo.overlong_buffer`, or 0 = DAPO's fifth of the limit (at least 1)."""
    if a.overlong_buffer:
        return a.overlong_buffer
    return max(1, int(DAPO_OVERLONG_FRACTION * max_new_tokens))
