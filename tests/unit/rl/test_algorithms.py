import math

import pytest
import torch

from rlhf_async.rl import algorithms as A


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def test_gae_undiscounted_returns_are_reward_to_go():
    adv, ret = A.gae(t([[0, 0, 1]]), t([[0.5, 0.6, 0.7]]), t([[1, 1, 1]]), 1.0, 1.0)
    assert torch.allclose(adv, t([[0.5, 0.4, 0.3]]))
    assert torch.allclose(ret, t([[1.0, 1.0, 1.0]]))


def test_gae_discounted_and_masked():
    adv, ret = A.gae(t([[0, 1, 5]]), t([[0.5, 0.4, 9]]), t([[1, 1, 0]]), 0.9, 0.5)
    # t=1: 1 - 0.4 = 0.6 ; t=0: 0.9*0.4 - 0.5 + 0.45*0.6 = 0.13 ; padding stays 0
    assert torch.allclose(adv, t([[0.13, 0.6, 0.0]]), atol=1e-6)
    assert torch.allclose(ret, t([[0.63, 1.0, 0.0]]), atol=1e-6)


def test_whiten_masked_and_global_equals_local_union():
    x, m = t([1, 2, 3, 100]), t([1, 1, 1, 0])
    s = math.sqrt(2 / 3)
    assert torch.allclose(A.whiten(x, m), t([-1 / s, 0, 1 / s, 0]), atol=1e-5)
    # two "ranks": each reduces its stats with the other's => same as whitening the union
    xa, ma, xb, mb = t([1, 2]), t([1, 1]), t([3, 100]), t([1, 0])

    def other(xo, mo):
        return lambda st: st + torch.stack([(xo * mo).sum(), (xo * xo * mo).sum(), mo.sum()]).double()

    out = torch.cat([A.whiten(xa, ma, other(xb, mb)), A.whiten(xb, mb, other(xa, ma))])
    assert torch.allclose(out, A.whiten(x, m), atol=1e-6)


def test_kl_estimators():
    lp, ref = t([math.log(0.5)]), t([math.log(0.25)])
    assert A.kl_per_token(lp, ref, "k1").item() == pytest.approx(math.log(2), abs=1e-6)
    assert A.kl_per_token(lp, ref, "k3").item() == pytest.approx(0.5 - 1 + math.log(2), abs=1e-6)
    assert A.kl_per_token(lp, lp, "k3").item() == 0.0
    with pytest.raises(ValueError, match="k1, k3"):
        A.kl_per_token(lp, ref, "k2")


def test_token_rewards_put_score_on_last_valid_token():
    r = A.token_rewards(t([2, 3]), t([[0.1, 0.2, 0.3], [0.5, 0.5, 0.5]]),
                        t([[1, 1, 0], [1, 1, 1]]), 0.1)
    assert torch.allclose(r, t([[-0.01, 1.98, 0.0], [-0.05, -0.05, 2.95]]), atol=1e-6)


def test_ppo_policy_loss_hand_values():
    lp = t([[math.log(1.5), math.log(0.5)]])
    old, adv, m = t([[0, 0]]), t([[1, -1]]), t([[1, 1]])
    loss, st = A.ppo_policy_loss(lp, old, adv, m, 0.2)
    assert loss.item() == pytest.approx((-1.2 + 0.8) / 2, abs=1e-6)
    assert st["clip_frac"].item() == pytest.approx(1.0)
    # truncated IS: weights min(exp(old - mu), 1.5) = [1.5, 0.5]
    mu = t([[math.log(0.5), math.log(2.0)]])
    w = A.importance_weights(old, mu, 1.5)
    loss, _ = A.ppo_policy_loss(lp, old, adv, m, 0.2, weights=w)
    assert loss.item() == pytest.approx((-1.2 * 1.5 + 0.8 * 0.5) / 2, abs=1e-6)
    # global normaliser and masking: padded token contributes nothing
    loss, _ = A.ppo_policy_loss(lp, old, adv, t([[1, 0]]), 0.2, normaliser=4.0)
    assert loss.item() == pytest.approx(-1.2 / 4, abs=1e-6)


def test_ppo_gradient_is_zero_when_clipped():
    lp = t([[math.log(1.5)]]).requires_grad_()
    loss, _ = A.ppo_policy_loss(lp, t([[0]]), t([[1]]), t([[1]]), 0.2)
    loss.backward()
    assert lp.grad.item() == 0.0


def test_value_loss_clipped():
    v = A.value_loss(t([[1.0, 7.0]]), t([[0.5, 0.0]]), t([[2.0, 0.0]]), t([[1, 0]]), 0.2)
    assert v.item() == pytest.approx(0.5 * 1.3**2, abs=1e-6)


def test_entropy_uniform():
    e = A.entropy_from_logits(torch.zeros(1, 2, 4))
    assert torch.allclose(e, torch.full((1, 2), math.log(4)))


def test_grpo_and_rloo():
    scores, groups = t([1, 2, 3, 10, 10]), torch.tensor([0, 0, 0, 7, 7])
    assert torch.allclose(A.grpo_advantages(scores, groups), t([-1, 0, 1, 0, 0]), atol=1e-5)
    assert torch.allclose(A.rloo_advantages(scores, groups), t([-1.5, 0, 1.5, 0, 0]))
    with pytest.raises(ValueError, match="at least 2"):
        A.rloo_advantages(t([1, 2]), torch.tensor([0, 1]))


def test_gather_logprobs_with_temperature():
    logits = t([[[0.0, math.log(3.0)]]])
    assert A.gather_logprobs(logits, torch.tensor([[1]])).item() == pytest.approx(math.log(0.75))
    lp2 = A.gather_logprobs(logits, torch.tensor([[1]]), temperature=2.0).item()
    assert lp2 == pytest.approx(math.log(math.sqrt(3) / (1 + math.sqrt(3))), abs=1e-6)


def test_kl_penalty_in_the_reward_does_not_enter_group_statistics():
    groups = torch.tensor([0, 0, 0, 1, 1])
    scores, kl = t([0, 0, 0, 1, 3]), t([0.1, 0.3, 0.2, 0.4, 0.0])
    adv = A.outcome_advantages(scores, groups, "group_mean", True, penalty=kl)
    # group 0: equal scores, no task advantage, the penalty alone (not / its std);
    # group 1: (r - 2) / std(1, 3) = -+1/sqrt(2), minus the penalty
    s = 2 ** -0.5
    assert torch.allclose(adv, t([-0.1, -0.3, -0.2, -s - 0.4, s]), atol=1e-5)
    # without group normalisation the penalty is part of the score (RLOO's baseline)
    loo = A.outcome_advantages(t([1, 2]), torch.tensor([0, 0]), "leave_one_out", False,
                               penalty=t([0.5, 0.0]))
    assert torch.allclose(loo, t([-1.5, 1.5]))
