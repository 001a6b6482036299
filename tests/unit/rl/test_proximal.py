"""Decoupled PPO (`algo.proximal`) by hand: the clip is centred on the trainer's weights at
the step's start (pi_prox), a token sampled by an older weight version than a synchronous
run's is weighted by min(pi_prox / mu, mismatch_cap), a fresh one by 1; at max_staleness = 0
(no stale token) the loss and update are today's."""

import math

import pytest
import torch

from rlhf_async.config import AlgoConfig, TrainConfig
from rlhf_async.modeling.rollout import RolloutBatch
from rlhf_async.rl import algorithms as A
from rlhf_async.rl.learner import Learner
from tests.unit.rl.test_learner_by_hand import Logits

HALF = math.log(0.5)
S = 2 ** -0.5  # the group's z-scored advantages of rewards (1, 0): +-1/sqrt(2)


def test_weights_and_loss_by_hand_on_mixed_version_tokens():
    # one response, 3 tokens sampled by versions (0, 1, 1); a synchronous run's is 1
    tv, m = torch.tensor([[0, 1, 1]]), torch.ones(1, 3)
    stale = A.stale_tokens(tv, 0, m, sync_version=1)
    assert stale.tolist() == [[True, False, False]]
    prox = torch.full((1, 3), HALF)
    mu = torch.log(torch.tensor([[0.25, 0.1, 0.9]]))  # the fresh tokens' mu is ignored
    w = A.proximal_weights(prox, mu, stale, cap=1.5, mode="tis", mask=m)
    assert w.flatten().tolist() == pytest.approx([1.5, 1.0, 1.0])  # min(0.5 / 0.25, 1.5)
    # policy at ratios (1.1, 1.5, 1) to pi_prox, advantage 1, clip 0.2: clipped at 1.2
    lp = (prox + torch.log(torch.tensor([[1.1, 1.5, 1.0]]))).requires_grad_()
    loss, _ = A.ppo_policy_loss(lp, prox, torch.ones(1, 3), m, 0.2, weights=w)
    assert loss.item() == pytest.approx(-(1.5 * 1.1 + 1.2 + 1.0) / 3, abs=1e-6)
    loss.backward()
    # d/d log pi = -w * r / 3 where unclipped, 0 where clipped
    assert lp.grad.flatten().tolist() == pytest.approx([-1.5 * 1.1 / 3, 0.0, -1.0 / 3],
                                                     abs=1e-6)


def test_sequence_level_weight_for_gspo():
    tv, m = torch.tensor([[0, 1], [1, 1]]), torch.ones(2, 2)
    stale = A.stale_tokens(tv, 0, m, sync_version=1)
    prox = torch.full((2, 2), HALF)
    mu = torch.log(torch.tensor([[0.25, 0.9], [0.9, 0.9]]))
    w = A.proximal_weights(prox, mu, stale, 10.0, "tis", m, level="sequence")
    # row 0: exp((log 2 + 0) / 2) = sqrt 2 on both tokens; row 1 fresh: 1
    assert w.flatten().tolist() == pytest.approx([2 ** 0.5, 2 ** 0.5, 1.0, 1.0])
    # without token versions every token has the batch's version
    assert A.stale_tokens(None, 0, m, 1).all() and not A.stale_tokens(None, 1, m, 1).any()


def _batch(token_versions, step):
    return RolloutBatch(
        prompt_ids=torch.tensor([[1], [1]]), prompt_mask=torch.ones(2, 1, dtype=torch.long),
        response_ids=torch.tensor([[0, 1], [1, 0]]), response_mask=torch.ones(2, 2,
                                                                             dtype=torch.long),
        behaviour_logprobs=torch.log(torch.tensor([[0.25, 0.1], [0.3, 0.7]])),
        sample_ids=torch.tensor([0, 1]), group_ids=torch.tensor([0, 0]),
        version=int(torch.tensor(token_versions).min()), step=step,
        rewards=torch.tensor([1.0, 0.0]), ref_logprobs=torch.full((2, 2), HALF),
        token_versions=torch.tensor(token_versions))


def _step(proximal, b):
    actor = Logits()
    a = AlgoConfig(name="grpo", kl_coef=0.0, kl_target=0.0, group_size=2, proximal=proximal,
                   mismatch_cap=1.5)
    t = TrainConfig(epochs=1, minibatches=1, lr=0.1, grad_clip=0.0)
    return Learner(actor, None, a, t, seed=0).train_step(b), actor.theta.detach().clone()


def test_on_by_default_which_acts_only_when_generation_runs_ahead():
    # measured better than off at max_staleness 1 and 2 (bench/README.md, Decoupled PPO)
    assert AlgoConfig().proximal and AlgoConfig(name="grpo").proximal


def test_at_max_staleness_zero_it_is_todays_loss():
    b = _batch([[1, 1], [1, 1]], step=1)  # every token of the synchronous version
    on, theta_on = _step(True, b)
    off, theta_off = _step(False, b)
    assert on["policy_loss"] == off["policy_loss"] == pytest.approx(0.0, abs=1e-7)
    assert torch.equal(theta_on, theta_off)


def test_learner_step_on_mixed_version_tokens_by_hand():
    # row 0 (reward 1, advantage +S): token 0 from version 0 (stale, mu 0.25: weight
    # min(0.5 / 0.25, 1.5) = 1.5), token 1 fresh; row 1 (advantage -S) fresh. Ratio 1:
    # loss = -(1.5 S + S - S - S) / 4 = -S / 8
    on, theta = _step(True, _batch([[0, 1], [1, 1]], step=1))
    assert on["policy_loss"] == pytest.approx(-S / 8, abs=1e-6)
    # gradient: -(1.5 - 1) S / 4 * (e_0 - 1/2) = (-S/16, +S/16) (the other tokens cancel):
    # AdamW's first step moves theta by lr * sign: towards token 0
    assert theta.tolist() == pytest.approx([0.1, -0.1], abs=1e-6)
    off, _ = _step(False, _batch([[0, 1], [1, 1]], step=1))
    assert off["policy_loss"] == pytest.approx(0.0, abs=1e-7)
