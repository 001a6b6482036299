"""The algorithm toolbox by hand: clip-higher, loss aggregation, GSPO's sequence ratio,
Dr. GRPO's and REINFORCE++'s advantages, the overlong penalty, TIS/MIS weights, the
learning-rate schedule and the presets. Every expected number is worked out in the test."""

import math

import pytest
import torch

from rlhf_async.config import AlgoConfig, ConfigError, TrainConfig, load_config
from rlhf_async.config.presets import overlong_buffer, resolve
from rlhf_async.modeling.rollout import RolloutBatch
from rlhf_async.rl import algorithms as A
from rlhf_async.rl.guards import NonFiniteError
from rlhf_async.rl.learner import Learner
from rlhf_async.rl.scoring import RewardMix
from tests.unit.rl.test_learner_by_hand import Logits, Value, batch


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def close(got, want):
    return torch.allclose(got.detach().float(), t(want), atol=1e-5)


def test_clip_higher_lets_a_rising_ratio_go_further():
    # ratios 1.25 (advantage +1) and 0.75 (advantage -1)
    lp, old, adv, m = t([[math.log(1.25), math.log(0.75)]]), t([[0, 0]]), t([[1, -1]]), t([[1, 1]])
    # symmetric 0.2: min(1.25, 1.2) * 1 = 1.2; min(-0.75, -0.8) = -0.8 -> (-1.2 + 0.8) / 2
    sym, _ = A.ppo_policy_loss(lp, old, adv, m, 0.2)
    assert sym.item() == pytest.approx(-0.2, abs=1e-6)
    # clip-higher 0.28: 1.25 is inside [0.8, 1.28], so it counts whole: (-1.25 + 0.8) / 2
    high, st = A.ppo_policy_loss(lp, old, adv, m, 0.2, 0.28)
    assert high.item() == pytest.approx(-0.225, abs=1e-6)
    assert st["clip_frac"].item() == pytest.approx(0.5)  # only the falling token is clipped


def test_each_loss_aggregation():
    # ratio 1 everywhere, so each token's term is -advantage; row 0 has 3 tokens, row 1 one
    lp = torch.zeros(2, 3)
    adv, m = t([[1, 2, 3], [4, 0, 0]]), t([[1, 1, 1], [1, 0, 0]])

    def loss(mode):
        return A.ppo_policy_loss(lp, lp, adv, m, 0.2, loss_agg=mode)[0].item()

    assert loss("token_mean") == pytest.approx(-(1 + 2 + 3 + 4) / 4)  # -2.5
    assert loss("seq_mean_token_sum") == pytest.approx(-(6 + 4) / 2)  # -5
    assert loss("seq_mean_token_mean") == pytest.approx(-(6 / 3 + 4 / 1) / 2)  # -3
    # global counts: the same rows as one shard of 4 tokens / 2 responses of a batch of 8 / 4
    glob = A.ppo_policy_loss(lp, lp, adv, m, 0.2, loss_agg="seq_mean_token_sum",
                             normaliser=8.0, n_seqs=4.0)[0]
    assert glob.item() == pytest.approx(-10 / 4)
    with pytest.raises(ValueError, match="accepted: token_mean"):
        loss("sum")


def test_gspo_sequence_ratio_value_and_gradient():
    # log ratios: row 0 (log 2, 0) -> sequence ratio exp(log 2 / 2) = sqrt 2; row 1
    # (log 0.5, log 0.5) -> 0.5. Advantage +1 on every token, clip 0.2, sequence mean.
    old = torch.zeros(2, 2)
    lp = t([[math.log(2.0), 0.0], [math.log(0.5), math.log(0.5)]]).requires_grad_()
    loss, _ = A.ppo_policy_loss(lp, old, torch.ones(2, 2), torch.ones(2, 2), 0.2,
                                ratio_level="sequence", loss_agg="seq_mean_token_mean")
    # row 0: min(1.414, 1.2) = 1.2 (clipped); row 1: min(0.5, 0.8) = 0.5 -> -(1.2 + 0.5) / 2
    assert loss.item() == pytest.approx(-0.85, abs=1e-6)
    loss.backward()
    # row 0 clipped: no gradient. Row 1: loss = -s / 2 with s = exp(mean of its 2 log-probs),
    # ds/dlp_t = s / 2 = 0.25, so d loss / d lp_t = -0.125 for both tokens
    assert close(lp.grad, [[0.0, 0.0], [-0.125, -0.125]])


def test_dr_grpo_advantages_drop_the_std():
    scores, groups = t([1, 0, 0, 0, 2, 4]), torch.tensor([0, 0, 0, 0, 1, 1])
    # group means 0.25 and 3: no division
    dr = A.outcome_advantages(scores, groups, "group_mean", group_norm=False)
    assert dr.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, -1.0, 1.0])
    # GRPO divides by the unbiased stds: sqrt((0.5625 + 3 * 0.0625) / 3) = 0.5, sqrt(2)
    grpo = A.outcome_advantages(scores, groups, "group_mean", group_norm=True, eps=0.0)
    s2 = math.sqrt(2.0)
    assert grpo.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5, -1 / s2, 1 / s2])
    # RLOO with the group std: leave-one-out (r - mean of the others), / the same std
    rl = A.outcome_advantages(scores, groups, "leave_one_out", group_norm=True, eps=0.0)
    assert rl.tolist() == pytest.approx([1 / 0.5, -1 / 3 / 0.5, -1 / 3 / 0.5, -1 / 3 / 0.5,
                                         -2 / s2, 2 / s2])


def _batch(rewards, response_mask, logprob_rows):
    B, R = len(rewards), len(response_mask[0])
    lp = t(logprob_rows)
    return RolloutBatch(
        prompt_ids=torch.ones(B, 1, dtype=torch.long),
        prompt_mask=torch.ones(B, 1, dtype=torch.long),
        response_ids=torch.zeros(B, R, dtype=torch.long),
        response_mask=torch.tensor(response_mask), behaviour_logprobs=lp,
        sample_ids=torch.arange(B), group_ids=torch.arange(B), version=0, step=0,
        rewards=t(rewards), ref_logprobs=torch.zeros(B, R))


def test_reinforce_pp_advantages_are_kl_returns_normalised_over_the_batch():
    algo = AlgoConfig(name="reinforce_pp", kl_coef=1.0, kl_target=0.0)
    lrn = Learner(Logits(), None, algo, TrainConfig(), seed=0)
    b = _batch([1.0, 0.0], [[1, 1], [1, 0]], [[0.1, 0.2], [0.3, 0.0]])
    # KL (k1, reference 0) = the log-probs: token rewards row 0 (-0.1, 1 - 0.2),
    # row 1 (-0.3); returns to go: (0.7, 0.8), (-0.3)
    adv, ret, kl = lrn._advantages(b, b.behaviour_logprobs * b.response_mask, None)
    x = [0.7, 0.8, -0.3]
    mean = sum(x) / 3
    std = math.sqrt(sum(v * v for v in x) / 3 - mean * mean)
    want = [[(0.7 - mean) / std, (0.8 - mean) / std], [(-0.3 - mean) / std, 0.0]]
    assert close(adv, want) and ret is None
    assert close(kl, [[0.1, 0.2], [0.3, 0.0]])


def test_overlong_penalty_ramps_over_the_buffer():
    # limit 8, buffer 2: free up to 6 tokens, then -(len - 6) / 2, -1 at 8
    got = A.overlong_penalty(torch.tensor([5, 6, 7, 8]), 8, 2, 1.0)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0])
    assert overlong_buffer(AlgoConfig(name="dapo"), 8) == 1  # a fifth of 8, at least 1
    assert overlong_buffer(AlgoConfig(name="dapo", overlong_buffer=3), 8) == 3
    # in the reward mix: on the reward, never on the hidden score
    mix = RewardMix(lambda p, r, m: m.sum(1).float(), rm_weight=0.0, rule_weight=1.0,
                    overlong_penalty=0.5, overlong_buffer=2, max_new_tokens=4)
    b = _batch([0.0, 0.0], [[1, 1, 1, 0], [1, 1, 1, 1]], [[0.0] * 4] * 2)
    rewards, hidden = mix.combine(torch.zeros(2), b)
    assert rewards.tolist() == pytest.approx([3 - 0.25, 4 - 0.5])
    assert hidden.tolist() == [3.0, 4.0]


def test_tis_and_mis_weights():
    old, mu = t([[math.log(3.0), math.log(0.5), math.log(1.5)]]), torch.zeros(1, 3)
    assert close(A.importance_weights(old, mu, 2.0, "tis"), [[2, 0.5, 1.5]])
    assert close(A.importance_weights(old, mu, 2.0, "mis"), [[0, 0.5, 1.5]])
    # per sequence: log ratios (log 4, 0) -> exp(log 2) = 2 for the whole response
    old, m = t([[math.log(4.0), 0.0]]), t([[1, 1]])
    seq = A.importance_weights(old, torch.zeros(1, 2), 1.5, "tis", m, "sequence")
    assert close(seq, [[1.5, 1.5]])
    assert A.importance_weights(old, torch.zeros(1, 2), 1.5, "mis", m, "sequence").sum() == 0


def test_learner_reports_the_mismatch_every_step():
    algo = AlgoConfig(name="grpo", group_size=2, mismatch="tis", mismatch_cap=1.5)
    lrn = Learner(Logits(), None, algo, TrainConfig(epochs=1, minibatches=1), seed=0)
    # the trainer's old log-probs are log 1/2 (theta = 0); the generator's log 1/4 and
    # log 1/2: ratios 2 (capped) and 1
    b = _batch([1.0, 0.0], [[1], [1]], [[math.log(0.25)], [math.log(0.5)]])
    b = b.replace(group_ids=torch.tensor([0, 0]), ref_logprobs=torch.full((2, 1), math.log(0.5)))
    out = lrn.train_step(b)
    assert out["mismatch/ratio_mean"] == pytest.approx(1.5)
    assert out["mismatch/ratio_max"] == pytest.approx(2.0)
    assert out["mismatch/capped_frac"] == pytest.approx(0.5)


def test_lr_schedules():
    cos = [A.lr_factor(s, 6, 2, "cosine") for s in range(6)]
    assert cos == pytest.approx([0.5, 1.0, 1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5,
                                 0.5 * (1 + math.cos(3 * math.pi / 4))])
    assert [A.lr_factor(s, 6, 2, "linear") for s in range(2, 6)] == pytest.approx(
        [1.0, 0.75, 0.5, 0.25])
    assert A.lr_factor(50, 100, 0, "constant") == 1.0


def test_presets_fill_only_what_the_user_left():
    dapo = resolve(load_config(None, ["algo.name=dapo"]).algo)
    assert (dapo.clip_low, dapo.clip_high, dapo.overlong_penalty) == (0.2, 0.28, 1.0)
    mine = resolve(load_config(None, ["algo.name=dapo", "algo.clip_eps_high=0.3",
                                      "algo.overlong_penalty=0", "algo.adv_norm=none"]).algo)
    assert (mine.clip_low, mine.clip_high, mine.overlong_penalty, mine.adv_norm) == (
        0.2, 0.3, 0.0, "none")
    gspo = resolve(AlgoConfig(name="gspo"))
    assert (gspo.ratio_level, gspo.loss_agg) == ("sequence", "seq_mean_token_mean")
    dr = resolve(AlgoConfig(name="dr_grpo"))
    assert (dr.adv_norm, dr.loss_agg) == ("none", "seq_mean_token_sum")
    assert resolve(AlgoConfig(name="reinforce_pp")).baseline == "none"
    # knobs alone, on plain GRPO; is_cap is TIS under its older name
    g = resolve(load_config(None, ["algo.name=grpo", "algo.loss_agg=seq_mean_token_sum",
                                   "algo.is_cap=3"]).algo)
    assert (g.loss_agg, g.mismatch, g.mismatch_cap) == ("seq_mean_token_sum", "tis", 3.0)


def test_algo_config_problems_are_reported():
    with pytest.raises(ConfigError) as ei:
        load_config(None, ["algo.name=ppo", "algo.adv_norm=group", "algo.is_cap=2",
                           "algo.mismatch=mis", "train.lr_schedule=cosine",
                           "train.warmup_steps=100"])
    text = str(ei.value)
    assert "algo.adv_norm" in text and "algo.is_cap" in text and "train.warmup_steps" in text


def test_an_overflowing_loss_stops_the_step_before_any_update():
    actor, critic = Logits(), Value()
    lrn = Learner(actor, critic, AlgoConfig(name="ppo"), TrainConfig(), seed=0)
    huge = batch().replace(rewards=t([1e30, 0.0]))  # (V - R)^2 overflows float32
    with pytest.raises(NonFiniteError, match=r"step 0: the critic loss is not finite \(inf\)"):
        lrn.train_step(huge)
    assert actor.theta.tolist() == [0.0, 0.0] and critic.v.item() == 0.0


def test_kl_placement_per_preset():
    place = {n: (resolve(AlgoConfig(name=n)).kl_mode, resolve(AlgoConfig(name=n)).kl_estimator)
             for n in ("ppo", "grpo", "rloo", "dapo", "gspo", "dr_grpo", "reinforce_pp")}
    assert place == {"ppo": ("reward", "k1"), "rloo": ("reward", "k1"),
                     "reinforce_pp": ("reward", "k1"), "grpo": ("loss", "k3"),
                     "dapo": ("loss", "k3"), "gspo": ("loss", "k3"), "dr_grpo": ("loss", "k3")}
    explicit = resolve(AlgoConfig(name="grpo", kl_mode="reward"))
    assert (explicit.kl_mode, explicit.kl_estimator) == ("reward", "k1")
    assert resolve(AlgoConfig(name="ppo", kl_mode="loss", kl_estimator="k1")).kl_estimator == "k1"


def test_cispo_loss_and_gradient_by_hand():
    # ratios 1.5 (advantage +1) and 0.5 (advantage -1); CISPO's weights clip(r, 0, 1.28)
    # are 1.28 and 0.5, constants: loss = -(1.28 * 1 * log 1.5 + 0.5 * -1 * log 0.5) / 2
    lp = t([[math.log(1.5), math.log(0.5)]]).requires_grad_()
    old, adv, m = t([[0, 0]]), t([[1, -1]]), t([[1, 1]])
    loss, st = A.cispo_policy_loss(lp, old, adv, m, 1.0, 0.28)
    want = -(1.28 * math.log(1.5) - 0.5 * math.log(0.5)) / 2
    assert loss.item() == pytest.approx(want, abs=1e-6)
    loss.backward()
    # d/d log pi = -w * A / 2: the clipped rising token still has a gradient (PPO's: 0)
    assert close(lp.grad, [[-0.64, 0.25]])
    assert st["clip_frac"].item() == pytest.approx(0.5)
    ppo_lp = lp.detach().clone().requires_grad_()
    A.ppo_policy_loss(ppo_lp, old, adv, m, 0.2, 0.28)[0].backward()
    assert ppo_lp.grad[0, 0].item() == 0.0


def test_cispo_preset():
    rc = resolve(AlgoConfig(name="cispo"))
    assert (rc.surrogate, rc.baseline, rc.adv_norm, rc.loss_agg, rc.kl_mode) == (
        "cispo", "group_mean", "group", "token_mean", "none")
    assert (rc.clip_low, rc.clip_high) == (1.0, 0.28)
    assert resolve(AlgoConfig(name="cispo", clip_eps_high=2.0)).clip_high == 2.0


def test_cispo_learner_step_has_no_kl_term():
    a = AlgoConfig(name="cispo", group_size=2)
    lrn = Learner(Logits(), None, a, TrainConfig(epochs=1, minibatches=1, lr=0.1), seed=0)
    b = batch(group_ids=(0, 0))
    b.ref_logprobs = b.ref_logprobs - 0.3  # a KL to the reference, measured only
    m = lrn.train_step(b)
    # advantages (1, 0) z-scored in the group: +-1/sqrt(2); weight 1 at the old policy,
    # log pi = log 1/2: loss = -(s * log .5 - s * log .5) / 2 = 0
    assert m["policy_loss"] == pytest.approx(0.0, abs=1e-6) and "kl_loss" not in m
    assert m["kl"] == pytest.approx(0.3, abs=1e-6)
    assert lrn.last_advantages.flatten().tolist() == pytest.approx([2 ** -0.5, -2 ** -0.5],
                                                                   abs=1e-5)
