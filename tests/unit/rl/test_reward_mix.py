"""How a sample's reward is made from a reward model's score and a task's rule."""

from __future__ import annotations

import pytest
import torch

from rlhf_async.modeling.rollout import RolloutBatch
from rlhf_async.rl.guards import NonFiniteError
from rlhf_async.rl.scoring import RewardMix

BATCH = RolloutBatch(torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2, dtype=torch.long),
                     torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2, dtype=torch.long),
                     torch.zeros(3, 2), torch.arange(3), torch.arange(3))
RULE = torch.tensor([1.0, 0.0, 0.5])


def rule(prompt_ids, response_ids, mask):
    return RULE.clone()


def test_weights_mix_the_learned_and_the_rule_reward():
    rm = torch.tensor([0.2, -0.4, 1.0])
    rewards, hidden = RewardMix(rule, rm_weight=2.0, rule_weight=0.5).combine(rm, BATCH)
    torch.testing.assert_close(rewards, 2.0 * rm + 0.5 * RULE)
    torch.testing.assert_close(hidden, RULE)  # the rule is the reported truth
    rewards, hidden = RewardMix(rule).combine(rm, BATCH)  # rule weight 0: reported only
    torch.testing.assert_close(rewards, rm)
    torch.testing.assert_close(hidden, RULE)


def test_without_a_reward_model_the_rule_is_the_reward_and_without_a_rule_the_model():
    rewards, hidden = RewardMix(rule).combine(None, BATCH)
    torch.testing.assert_close(rewards, RULE)
    rm = torch.tensor([0.3, 0.1, -0.2])
    rewards, hidden = RewardMix(None, rm_weight=0.5).combine(rm, BATCH)
    torch.testing.assert_close(rewards, 0.5 * rm)
    torch.testing.assert_close(hidden, rm)
    with pytest.raises(ValueError, match="a rule weight needs a rule"):
        RewardMix(None, rule_weight=1.0)


def test_a_non_finite_reward_model_score_stops_the_step_naming_it():
    mix = RewardMix(None)
    b = _guard_batch()
    with pytest.raises(NonFiniteError, match=r"step 7: a reward is not finite \(nan\) "
                       r"\(samples \[11\]\)"):
        mix.combine(torch.tensor([1.0, float("nan")]), b)
    rewards, _ = mix.combine(torch.tensor([1.0, 1e30]), b)  # huge but finite: the learner's
    assert rewards.tolist() == pytest.approx([1.0, 1e30])


def _guard_batch() -> RolloutBatch:
    return RolloutBatch(
        prompt_ids=torch.ones(2, 1, dtype=torch.long), prompt_mask=torch.ones(2, 1, dtype=torch.long),
        response_ids=torch.zeros(2, 2, dtype=torch.long),
        response_mask=torch.ones(2, 2, dtype=torch.long), behaviour_logprobs=torch.zeros(2, 2),
        sample_ids=torch.tensor([10, 11]), group_ids=torch.tensor([0, 0]), version=0, step=7)
