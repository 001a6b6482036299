"""One Learner step on a 2-sample batch, checked against numbers worked out by hand.

The policy is a bare logits vector theta over a 2-token vocabulary (the same at every
position) and the critic a bare value v, so every quantity has a closed form: with
theta = 0 both tokens have probability 1/2 and d log p(k) / d theta = e_k - (1/2, 1/2).
Sample 0 answers token 0 and is rewarded 1; sample 1 answers token 1 and is rewarded 0.
AdamW's first step moves each parameter by lr * sign(gradient) (m_hat / sqrt(v_hat) = +-1),
so a right update sends theta to (+lr, -lr): towards the rewarded token. A flipped
advantage sign sends it the other way and fails these tests.
"""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from rlhf_async.config import AlgoConfig, TrainConfig
from rlhf_async.modeling.rollout import RolloutBatch
from rlhf_async.rl.learner import Learner

LR = 0.1


class Logits(nn.Module):
    """An 'LM' whose next-token logits are one learnable vector."""

    def __init__(self) -> None:
        super().__init__()
        self.theta = nn.Parameter(torch.zeros(2))

    def forward(self, input_ids, attention_mask=None, position_ids=None, **_):
        B, L = input_ids.shape
        return SimpleNamespace(logits=self.theta.expand(B, L, 2))


class Value(nn.Module):
    """A 'critic' that predicts one learnable value everywhere."""

    def __init__(self) -> None:
        super().__init__()
        self.v = nn.Parameter(torch.zeros(()))

    def forward(self, ids, mask, pos):
        return self.v.expand(ids.shape)


def batch(group_ids=(0, 1)) -> RolloutBatch:
    half = torch.full((2, 1), float(torch.log(torch.tensor(0.5))))
    return RolloutBatch(
        prompt_ids=torch.tensor([[1], [1]]), prompt_mask=torch.ones(2, 1, dtype=torch.long),
        response_ids=torch.tensor([[0], [1]]), response_mask=torch.ones(2, 1, dtype=torch.long),
        behaviour_logprobs=half, sample_ids=torch.tensor([0, 1]),
        group_ids=torch.tensor(group_ids), version=0, step=0,
        rewards=torch.tensor([1.0, 0.0]), ref_logprobs=half.clone())


def learner(algo: str, epochs: int = 1, clip_eps: float = 0.2) -> tuple[Learner, Logits, Value]:
    actor, critic = Logits(), Value()
    a = AlgoConfig(name=algo, whiten_advantages=False, clip_eps=clip_eps, vf_coef=1.0,
                   value_clip=10.0, group_size=2)
    t = TrainConfig(epochs=epochs, minibatches=1, lr=LR, critic_lr=LR, grad_clip=0.0)
    return Learner(actor, critic if algo == "ppo" else None, a, t, seed=0), actor, critic


def test_ppo_step_by_hand():
    lrn, actor, critic = learner("ppo")
    m = lrn.train_step(batch())
    # advantages (length-1 responses, gamma 1, V = 0): A = r - V = (1, 0); returns = r.
    # policy loss = -mean(ratio * A) = -(1 + 0) / 2 at ratio 1
    assert m["policy_loss"] == pytest.approx(-0.5, abs=1e-6)
    # value loss = 0.5 * mean((V - R)^2) = 0.5 * (1 + 0) / 2
    assert m["value_loss"] == pytest.approx(0.25, abs=1e-6)
    assert m["clip_frac"] == 0.0 and m["kl"] == pytest.approx(0.0, abs=1e-7)
    # d loss / d theta = -(1/2) * 1 * (1/2, -1/2) = (-1/4, +1/4): theta -> (+lr, -lr)
    assert actor.theta.tolist() == pytest.approx([LR, -LR], abs=1e-6)
    # d value loss / d v = (1/2) * ((V - 1) + (V - 0)) = -1/2: v -> +lr
    assert critic.v.item() == pytest.approx(LR, abs=1e-6)
    assert m["reward"] == pytest.approx(0.5) and m["samples"] == 2.0


def test_ppo_clips_the_ratio_in_its_second_epoch():
    lrn, actor, _ = learner("ppo", epochs=2, clip_eps=0.05)
    m = lrn.train_step(batch())
    # after epoch 1, p(0) = e^lr / (e^lr + e^-lr) = 0.5498: ratio 1.0997 > 1 + 0.05 for the
    # rewarded sample (A = 1), clipped; sample 1 has ratio 0.9003 < 0.95 but A = 0, and a
    # zero advantage is never counted as clipped. clip_frac = mean(0, 1/2) over 2 updates.
    assert m["clip_frac"] == pytest.approx(0.25, abs=1e-6)
    assert actor.theta[0].item() > LR  # Adam's momentum keeps moving it the same way


def test_grpo_step_by_hand():
    lrn, actor, _ = learner("grpo")
    m = lrn.train_step(batch(group_ids=(0, 0)))  # one prompt, two responses
    # advantages: (r - mean) / (sample std + eps) = (+-0.5) / 0.7071 = +-0.7071
    # policy loss = -mean(ratio * A) = -(0.7071 - 0.7071) / 2 = 0
    assert m["policy_loss"] == pytest.approx(0.0, abs=1e-6)
    assert m["advantage_abs"] == pytest.approx(0.5 ** 0.5, abs=1e-5)
    # gradient = -(1/2) * [0.7071 * (1/2, -1/2) - 0.7071 * (-1/2, 1/2)] = (-0.354, 0.354)
    assert actor.theta.tolist() == pytest.approx([LR, -LR], abs=1e-6)
    assert "value_loss" not in m


def test_adaptive_kl_controller_moves_the_coefficient_towards_the_target():
    from rlhf_async.rl.algorithms import adaptive_kl_coef

    assert adaptive_kl_coef(0.1, kl=4.0, target=2.0, horizon=10) == pytest.approx(0.102)
    assert adaptive_kl_coef(0.1, kl=1.9, target=2.0, horizon=10) == pytest.approx(0.0995)
    assert adaptive_kl_coef(0.1, kl=0.0, target=2.0, horizon=10) == pytest.approx(0.098)
    assert adaptive_kl_coef(0.1, kl=0.0, target=2.0, horizon=10, floor=0.1) == 0.1
    lrn, _, _ = learner("ppo")
    lrn.algo = AlgoConfig(name="ppo", whiten_advantages=False, kl_target=1.0, kl_coef=0.05,
                          kl_horizon=10)
    lrn.kl_coef = 0.1  # raised earlier
    m = lrn.train_step(batch())  # KL 0 < target: it drops by 2%, not below kl_coef
    assert m["kl_coef"] == 0.1 and lrn.kl_coef == pytest.approx(0.098)


# per-token KL (k1 = log pi - log ref, pi = 1/2 everywhere): row 0 (0.1, 0.5), row 1 (0.2)
@pytest.mark.parametrize("loss_agg,expected", [
    ("token_mean", (0.1 + 0.5 + 0.2) / 3),  # every token of the batch alike
    ("seq_mean_token_sum", ((0.1 + 0.5) + 0.2) / 2),  # each response's sum, over responses
    ("seq_mean_token_mean", ((0.1 + 0.5) / 2 + 0.2) / 2)])  # each response's mean
def test_kl_in_loss_aggregated_like_the_policy_term(loss_agg, expected):
    half = float(torch.log(torch.tensor(0.5)))
    kl = torch.tensor([[0.1, 0.5], [0.2, 0.0]])
    b = RolloutBatch(
        prompt_ids=torch.tensor([[1], [1]]), prompt_mask=torch.ones(2, 1, dtype=torch.long),
        response_ids=torch.tensor([[0, 1], [1, 0]]),
        response_mask=torch.tensor([[1, 1], [1, 0]]),
        behaviour_logprobs=torch.full((2, 2), half), sample_ids=torch.tensor([0, 1]),
        group_ids=torch.tensor([0, 0]), version=0, step=0,
        rewards=torch.tensor([1.0, 1.0]), ref_logprobs=half - kl)
    a = AlgoConfig(name="grpo", kl_mode="loss", kl_estimator="k1", kl_coef=0.5,
                   kl_target=0.0, loss_agg=loss_agg, group_size=2)
    t = TrainConfig(epochs=1, minibatches=1, lr=LR, grad_clip=0.0)
    lrn = Learner(Logits(), None, a, t, seed=0)
    m = lrn.train_step(b)
    assert m["kl_loss"] == pytest.approx(expected, abs=1e-6)
    assert m["policy_loss"] == pytest.approx(0.0, abs=1e-7)  # equal rewards: no advantage


def test_grpo_kl_in_reward_all_equal_group_trains_on_the_penalty_alone():
    b = batch(group_ids=(0, 0))
    b.rewards = torch.tensor([0.0, 0.0])
    b.ref_logprobs = b.ref_logprobs - torch.tensor([[0.1], [0.3]])  # k1 KL 0.1, 0.3
    a = AlgoConfig(name="grpo", kl_mode="reward", kl_coef=0.5, kl_target=0.0, group_size=2)
    lrn = Learner(Logits(), None, a, TrainConfig(epochs=1, minibatches=1, lr=LR), seed=0)
    lrn.train_step(b)
    # no task advantage; -kl_coef * KL, not the penalty's z-score (-+0.71)
    assert lrn.last_advantages.flatten().tolist() == pytest.approx([-0.05, -0.15], abs=1e-6)
