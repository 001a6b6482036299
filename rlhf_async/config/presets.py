"""The algorithm: its knobs (`AlgoConfig`, the `[algo]` section) and the `algo.name` presets.
Each algorithm is a set of values for orthogonal knobs that a user can also set alone
(`algo.loss_agg`, `algo.adv_norm`, ...). A knob left at its "preset's"
value ('' for a choice, 0 for a clip, -1 for the overlong penalty) takes the preset's; an
explicit value wins. `resolve` turns an `AlgoConfig` into the concrete `Recipe` the learner
and the reward mix read, so the preset table lives here only; what the rest of the
library asks of an algorithm it asks of the `Recipe` (`has_critic`, `needs_groups`).

Where the KL penalty to the reference goes is each paper's: in the loss for the GRPO family
(grpo, dr_grpo, dapo, gspo: GRPO's objective puts beta*KL beside the policy term), with the
k3 estimator (unbiased and positive; k1 in the loss made the built-in task collapse), in the
reward for ppo, rloo and reinforce_pp (InstructGPT), with k1; none for cispo (MiniMax-M1).

The advantage's baseline is the preset's alone (it is what names an algorithm):
gae (PPO's critic), group_mean (GRPO and its descendants), leave_one_out (RLOO), none
(REINFORCE++: the reward minus the KL still to come, normalised over the batch), distill
(on-policy distillation: no reward at all; the teacher's per-token term, `rl/distill.py`).
`algo.advantage_estimator` and `algo.policy_loss` replace the preset's estimator and loss
by name; the names are the registries' in `rl/registry.py` (this layer sits below it: the
names are checked there, `name_problems`, before a job does any work).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlhf_async.config.fields import opt

DAPO_OVERLONG_FRACTION = 0.2  # DAPO's buffer: 4096 of 20480 tokens


@dataclass(frozen=True)
class Recipe:
    """Concrete values of every algorithm knob (nothing left to a preset)."""

    baseline: str  # the advantage estimator's name (`rl/registry.py`)
    adv_norm: str  # group | batch | none
    loss_agg: str  # token_mean | seq_mean_token_sum | seq_mean_token_mean
    ratio_level: str  # token | sequence
    clip_low: float
    clip_high: float
    overlong_penalty: float  # the reward's penalty at max_new_tokens; 0 = off
    mismatch: str  # none | tis | mis
    mismatch_cap: float
    kl_mode: str  # reward | loss | none
    kl_estimator: str  # k1 | k3
    surrogate: str = "clip"  # the policy loss's name (`rl/registry.py`): clip, cispo, ...
    proximal: bool = False  # decoupled PPO: stale tokens weighted by pi_prox / behaviour

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
    return {"baseline": "gae", "adv_norm": "batch" if a.whiten_advantages else "none",
            "kl_mode": "reward"}


def grpo(a: AlgoConfig) -> dict[str, Any]:
    """GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300): no critic; a response's
    advantage is its reward minus its group's mean, over the group's std; the KL to the
    reference in the loss (eq. 3), k3."""
    return {"baseline": "group_mean", "adv_norm": "group", "kl_mode": "loss"}


def rloo(a: AlgoConfig) -> dict[str, Any]:
    """RLOO (Ahmadian et al. 2024, arXiv:2402.14740): the reward minus the mean of the
    other responses to the same prompt, not normalised; the KL in the reward."""
    return {"baseline": "leave_one_out", "adv_norm": "none", "kl_mode": "reward"}


def dapo(a: AlgoConfig) -> dict[str, Any]:
    """DAPO (Yu et al. 2025, arXiv:2503.14476): GRPO's advantages with clip-higher
    (eps_low 0.2, eps_high 0.28), the token-mean loss over the whole batch, and the soft
    overlong penalty on the reward (a linear ramp to -1 over the last fifth of
    `max_new_tokens`). Dynamic sampling, its fourth part, is not a knob of this preset.
    The paper also drops the KL term; here the KL keys keep the job's values (the
    built-in task's reward model is exploited without them), in the loss as GRPO's:
    `algo.kl_coef = 0 algo.kl_target = 0` drops it."""
    return {"baseline": "group_mean", "adv_norm": "group", "loss_agg": "token_mean",
            "kl_mode": "loss",
            "clip_low": 0.2, "clip_high": 0.28, "overlong_penalty": 1.0}


def gspo(a: AlgoConfig) -> dict[str, Any]:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071): GRPO's advantages with the sequence's
    length-normalised likelihood ratio (exp of the mean per-token log ratio), clipped per
    sequence in a narrow range (3e-4 below, 4e-4 above), the loss a mean over sequences;
    the KL in the loss, as GRPO's."""
    return {"baseline": "group_mean", "adv_norm": "group", "ratio_level": "sequence",
            "kl_mode": "loss",
            "loss_agg": "seq_mean_token_mean", "clip_low": 3e-4, "clip_high": 4e-4}


def dr_grpo(a: AlgoConfig) -> dict[str, Any]:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
    Perspective", arXiv:2503.20783): GRPO without its two biases: the advantage is not
    divided by the group's std, and the loss is not divided by each response's length
    (token sums, averaged over sequences); the KL in the loss, as GRPO's."""
    return {"baseline": "group_mean", "adv_norm": "none", "loss_agg": "seq_mean_token_sum",
            "kl_mode": "loss"}


def reinforce_pp(a: AlgoConfig) -> dict[str, Any]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): no critic and no per-prompt baseline; a
    token's advantage is the reward minus the KL penalty of it and the tokens after it,
    normalised (z-score) over every token of the global batch (the KL in the reward)."""
    return {"baseline": "none", "adv_norm": "batch", "kl_mode": "reward"}


def cispo(a: AlgoConfig) -> dict[str, Any]:
    """CISPO (MiniMax-M1, arXiv:2506.13585): GRPO's group-normalised advantages with a
    REINFORCE loss whose per-token importance weight pi / pi_old is clipped and
    stop-gradiented (not the update: every token keeps its gradient), the token-mean loss,
    and no KL term. The paper sets no lower bound (clip_low 1: the weight >= 0) and tunes the
    upper one without giving it; 0.28 here (`algo.clip_eps_high`, DAPO's clip-higher)."""
    return {"baseline": "group_mean", "adv_norm": "group", "loss_agg": "token_mean",
            "clip_low": 1.0, "clip_high": 0.28, "kl_mode": "none", "surrogate": "cispo"}


def distill(a: AlgoConfig) -> dict[str, Any]:
    """On-policy distillation (Agarwal et al. 2024, GKD, arXiv:2306.13649; Thinking Machines
    2025, "On-Policy Distillation"): no reward and no critic; each token's advantage is the
    negative reverse KL to `teacher.path` on the student's own sample, log pi_teacher(token)
    - log pi_student(token) (x `algo.distill_coef`, 0 = 1), not normalised; the teacher is
    the anchor, so no KL to the reference is penalised (measured only)."""
    return {"baseline": "distill", "adv_norm": "none", "kl_mode": "none"}


PRESETS: dict[str, Callable[[AlgoConfig], dict[str, Any]]] = {
    f.__name__: f for f in (ppo, grpo, rloo, dapo, gspo, dr_grpo, reinforce_pp, cispo,
                            distill)}


def resolve(a: AlgoConfig) -> Recipe:
    """The concrete knobs of `a`: its explicit values, else its preset's, else the plain
    ones (token-level ratio, token-mean loss, the symmetric `clip_eps`, no penalty).
    `algo.is_cap` (deprecated: the loader warns) is TIS with that cap."""
    p = PRESETS[a.name](a)
    mismatch, cap = a.mismatch, a.mismatch_cap
    if mismatch == "none" and a.is_cap > 0:
        mismatch, cap = "tis", a.is_cap
    kl_mode = a.kl_mode or p["kl_mode"]
    return Recipe(
        baseline=a.advantage_estimator or p["baseline"], adv_norm=a.adv_norm or p["adv_norm"],
        loss_agg=a.loss_agg or p.get("loss_agg", "token_mean"),
        ratio_level=a.ratio_level or p.get("ratio_level", "token"),
        clip_low=a.clip_eps_low or p.get("clip_low", a.clip_eps),
        clip_high=a.clip_eps_high or p.get("clip_high", a.clip_eps),
        overlong_penalty=(a.overlong_penalty if a.overlong_penalty >= 0
                          else p.get("overlong_penalty", 0.0)),
        mismatch=mismatch, mismatch_cap=cap, kl_mode=kl_mode,
        kl_estimator=a.kl_estimator or ("k3" if kl_mode == "loss" else "k1"),
        surrogate=a.policy_loss or p.get("surrogate", "clip"), proximal=a.proximal)


def distills(a: AlgoConfig) -> bool:
    """Whether `a` trains on a teacher's per-token term (the preset, or `distill_coef`)."""
    return a.name == "distill" or a.distill_coef > 0


def distill_weight(a: AlgoConfig) -> float:
    """The per-token distillation term's weight in the advantage (0 = none)."""
    return a.distill_coef or (1.0 if a.name == "distill" else 0.0)


def with_critic() -> list[str]:
    """The presets whose algorithm trains a critic."""
    return [name for name in PRESETS if resolve(AlgoConfig(name=name)).has_critic]


def overlong_buffer(a: AlgoConfig, max_new_tokens: int) -> int:
    """Tokens before `max_new_tokens` over which the overlong penalty ramps up:
    `algo.overlong_buffer`, or 0 = DAPO's fifth of the limit (at least 1)."""
    if a.overlong_buffer:
        return a.overlong_buffer
    return max(1, int(DAPO_OVERLONG_FRACTION * max_new_tokens))


# the knobs, after PRESETS: `algo.name` accepts the presets' names
@dataclass
class AlgoConfig:
    name: str = opt("ppo", "RL algorithm: a preset of the knobs below that are left at "
                    "their preset's value (config/presets.py; each cites its paper)",
                    choices=tuple(PRESETS))
    advantage_estimator: str = opt("", "the advantage estimator by name, a key of "
                                   "ADVANTAGE_ESTIMATORS in rl/registry.py: gae (ppo), "
                                   "group_mean (grpo and its descendants), leave_one_out "
                                   "(rloo), none (reinforce_pp), distill, or one registered "
                                   "there; '' = the preset's")
    policy_loss: str = opt("", "the policy loss by name, a key of POLICY_LOSSES in "
                           "rl/registry.py: clip (PPO's clipped ratio), cispo, or one "
                           "registered there; '' = the preset's (cispo for cispo, else clip)")
    kl_coef: float = opt(0.05, "weight of the KL penalty to the reference (with kl_target > "
                         "0: its floor)", ge=0.0)
    kl_target: float = opt(5.0, "adaptive KL controller: raise the KL weight while the KL to "
                           "the reference per sample (nats) is above this; 0 = fixed kl_coef",
                           ge=0.0)
    kl_horizon: float = opt(1.0, "adaptive KL controller: steps over which the weight moves "
                            "by at most 20%", gt=0.0)
    kl_estimator: str = opt("", "per-token KL estimator: k1 (log ratio), k3 (r - 1 - log r, "
                            "positive); '' = k3 with the KL in the loss, else k1",
                            choices=("", "k1", "k3"))
    kl_mode: str = opt("", "where the KL penalty goes: reward (per token, InstructGPT), loss "
                       "(aggregated like the policy term, GRPO), none (measured, not "
                       "penalised); '' = the preset's (grpo, dr_grpo, dapo, gspo loss; ppo, "
                       "rloo, reinforce_pp reward; cispo none)",
                       choices=("", "reward", "loss", "none"))
    clip_eps: float = opt(0.2, "PPO ratio clip", gt=0.0)
    clip_eps_low: float = opt(0.0, "ratio clip below 1 (ratio >= 1 - clip_eps_low; cispo: "
                              "its IS weight's); 0 = the preset's (dapo 0.2, gspo 3e-4, cispo "
                              "1 = none), else clip_eps", ge=0.0, le=1.0)
    clip_eps_high: float = opt(0.0, "ratio clip above 1 (clip-higher: ratio <= 1 + "
                               "clip_eps_high; cispo: its IS weight's); 0 = the preset's (dapo "
                               "0.28, gspo 4e-4, cispo 0.28), else clip_eps", ge=0.0)
    loss_agg: str = opt("", "how per-token policy losses make the loss: token_mean (over "
                        "every token of the batch), seq_mean_token_sum (each response's sum, "
                        "averaged over responses: no length normalisation), "
                        "seq_mean_token_mean (each response's mean, averaged over "
                        "responses); '' = the preset's (token_mean; gspo seq_mean_token_mean, "
                        "dr_grpo seq_mean_token_sum)",
                        choices=("", "token_mean", "seq_mean_token_sum", "seq_mean_token_mean"))
    ratio_level: str = opt("", "importance ratio per token, or per sequence (GSPO: exp of "
                           "the response's mean log ratio); '' = the preset's (gspo "
                           "sequence, else token)", choices=("", "token", "sequence"))
    adv_norm: str = opt("", "advantage normalisation: group (over the std of the prompt's "
                        "responses), batch (z-score over every token of the global batch), "
                        "none; '' = the preset's (ppo batch unless whiten_advantages = false, "
                        "grpo/dapo/gspo group, rloo/dr_grpo none, reinforce_pp batch)",
                        choices=("", "group", "batch", "none"))
    overlong_penalty: float = opt(-1.0, "DAPO's soft overlong penalty: a response ending in "
                                  "the last overlong_buffer tokens before "
                                  "generation.max_new_tokens loses up to this much reward, "
                                  "linearly (all of it at the limit); 0 = off; -1 = the "
                                  "preset's (dapo 1, else off)", ge=-1.0)
    overlong_buffer: int = opt(0, "tokens before max_new_tokens over which the overlong "
                               "penalty ramps; 0 = a fifth of max_new_tokens (DAPO's), at "
                               "least 1", ge=0)
    mismatch: str = opt("none", "correct the gap between the generator's (behaviour) and "
                        "the trainer's log-probs of the same policy (another engine, bf16; stale "
                        "rollouts): tis = weight each token's loss by min(ratio, "
                        "mismatch_cap), mis = drop tokens (sequences, with ratio_level = "
                        "sequence) whose ratio is above mismatch_cap", choices=("none", "tis",
                                                                                "mis"))
    mismatch_cap: float = opt(2.0, "the cap of algo.mismatch and algo.proximal", gt=0.0)
    proximal: bool = opt(True, "decoupled PPO (AReaL): the clip stays centred on the "
                         "trainer's weights at the step's start (the proximal policy) and a "
                         "token sampled by an older weight version than a synchronous run's "
                         "is weighted by pi_prox / behaviour, capped by mismatch_cap "
                         "(algo.mismatch's mode, tis when none); no effect at max_staleness "
                         "= 0, so on by default applies it whenever max_staleness > 0 "
                         "(measured better than off at 1 and 2: bench/README.md)")
    value_clip: float = opt(0.2, "PPO value clip", gt=0.0)
    vf_coef: float = opt(0.5, "value-loss weight (ppo)", ge=0.0)
    entropy_coef: float = opt(0.0, "entropy bonus weight", ge=0.0)
    gamma: float = opt(1.0, "discount (ppo GAE)", ge=0.0, le=1.0)
    lam: float = opt(0.95, "GAE lambda (ppo)", ge=0.0, le=1.0)
    whiten_advantages: bool = opt(True, "whiten advantages over the global batch (ppo)")
    group_size: int = opt(4, "responses sampled per prompt (grpo/rloo need >= 2)", ge=1)
    is_cap: float = opt(0.0, "deprecated (a warning at load): the older name of mismatch = "
                        "'tis' with mismatch_cap = is_cap; 0 = off", ge=0.0)
    max_staleness: int = opt(0, "weight versions generation may run ahead of training", ge=0)
    dynamic_sampling: bool = opt(False, "grpo/rloo (DAPO): drop groups whose rewards are all "
                                 "equal and refill the step with new groups (Flattening, "
                                 "Interleaving)")
    dynamic_sampling_max_tries: int = opt(3, "refill rounds per step at most (each one "
                                          "train.prompts_per_step new prompts)", ge=1)
    distill_coef: float = opt(0.0, "weight of on-policy distillation's per-token term "
                              "(log pi_teacher - log pi_student, teacher.path) added to the "
                              "advantage of any algorithm; 0 = none (algo.name = 'distill': 1)",
                              ge=0.0)
