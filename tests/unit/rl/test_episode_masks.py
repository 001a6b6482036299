"""The RL math over a multi-turn episode's mask: environment tokens (holes in the mask) are
skipped, as if the policy's tokens were contiguous."""

from __future__ import annotations

import torch

from rlhf_async.modeling.rollout import ENV, POLICY, RolloutBatch, loss_mask
from rlhf_async.rl import algorithms as A


def test_gae_skips_environment_tokens():
    # policy, policy, env, env, policy, pad: the same numbers as the 3 policy tokens alone
    m = torch.tensor([[1.0, 1, 0, 0, 1, 0]])
    r = torch.tensor([[0.0, 0.5, 9, 9, 1.0, 9]])
    v = torch.tensor([[0.2, 0.4, 7, 7, 0.6, 7]])
    adv, ret = A.gae(r, v, m, gamma=0.9, lam=0.8)
    keep = m[0] > 0
    adv3, ret3 = A.gae(r[:, keep], v[:, keep], m[:, keep], gamma=0.9, lam=0.8)
    assert torch.allclose(adv[:, keep], adv3) and torch.allclose(ret[:, keep], ret3)
    assert (adv[:, ~keep] == 0).all() and (ret[:, ~keep] == 0).all()
    # by hand: d2 = 1 - 0.6 = 0.4; d1 = 0.5 + 0.9*0.6 - 0.4 = 0.64; d0 = 0.9*0.4 - 0.2 = 0.16
    # A2 = 0.4, A1 = 0.64 + 0.72*0.4 = 0.928, A0 = 0.16 + 0.72*0.928 = 0.82816
    assert torch.allclose(adv3, torch.tensor([[0.82816, 0.928, 0.4]]))


def test_the_score_goes_on_the_last_policy_token():
    m = torch.tensor([[1.0, 0, 0, 1, 0], [1.0, 1, 0, 0, 0], [0.0, 0, 0, 0, 0]])
    r = A.token_rewards(torch.tensor([2.0, 3.0, 4.0]), torch.zeros(3, 5), m, 0.1)
    assert r.tolist() == [[0, 0, 0, 2, 0], [0, 3, 0, 0, 0], [0, 0, 0, 0, 0]]


def test_loss_mask_keeps_the_policy_tokens():
    mask = torch.tensor([[POLICY, ENV, ENV, POLICY, 0]])
    assert loss_mask(mask).tolist() == [[1.0, 0, 0, 1, 0]]
    b = RolloutBatch(torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long),
                     torch.arange(5)[None], mask, torch.zeros(1, 5), torch.zeros(1, dtype=torch.long),
                     torch.zeros(1, dtype=torch.long), env_rewards=torch.ones(1))
    b.validate()
    assert b.turns(lambda ids: " ".join(map(str, ids))) == [[
        {"role": "prompt", "text": "1 1"}, {"role": "policy", "text": "0"},
        {"role": "environment", "text": "1 2"}, {"role": "policy", "text": "3"}]]
    again = RolloutBatch.from_tensors(b.to_tensors(), b.meta())
    assert torch.equal(again.env_rewards, b.env_rewards)


def test_episode_ends_travel_and_are_counted_per_step():
    from rlhf_async.modeling.episodes import ENDS
    from rlhf_async.rl.step_stats import global_stats

    END_DONE, END_TRUNCATED, END_TIMEOUT = (ENDS.index(k) for k in ("done", "truncated",
                                                                     "timeout"))

    B, mask = 4, torch.tensor([[POLICY, ENV, POLICY]] * 4)
    ends = torch.tensor([END_DONE, END_TRUNCATED, END_TRUNCATED, END_TIMEOUT])
    b = RolloutBatch(torch.ones(B, 2, dtype=torch.long), torch.ones(B, 2, dtype=torch.long),
                     torch.ones(B, 3, dtype=torch.long), mask, torch.zeros(B, 3),
                     torch.arange(B), torch.arange(B), rewards=torch.tensor([1.0, 0, 0, 0]),
                     episode_ends=ends, episode_segments=torch.tensor([1, 3, 1, 2]))
    again = RolloutBatch.from_tensors(b.to_tensors(), b.meta())  # the wire keeps them
    assert torch.equal(again.episode_ends, ends)
    assert again.episode_segments is not None and again.episode_segments.tolist() == [1, 3, 1, 2]
    s = global_stats(again, torch.zeros(B, 3), torch.zeros(B, 3), {}, 1)
    assert {k: s[k] for k in s if k.startswith("episodes/")} == {
        "episodes/done": 1.0, "episodes/max_turns": 0.0, "episodes/truncated": 2.0,
        "episodes/timeout": 1.0, "episodes/failed": 0.0,
        "episodes/new_segments": 3.0}  # counts, not fractions; an agent's extra histories
    assert s["reward"] == 0.25 and s["samples"] == 4.0


def test_an_agents_earlier_segment_trains_with_its_episodes_advantage_uncounted():
    """Rows 0-3: episodes of groups 0 and 1 (two each); row 4: an earlier segment of row
    2's episode (the agent rewrote its history), `episode_segments` 0."""
    from rlhf_async.modeling.episodes import ENDS
    from rlhf_async.rl.step_stats import global_stats

    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0])
    groups, sids = torch.tensor([0, 0, 1, 1, 1]), torch.tensor([0, 1, 2, 3, 2])
    segments = torch.tensor([1, 1, 2, 1, 0])
    adv = A.episode_advantages(rewards, groups, sids, segments, "group_mean", True)
    # each group's episodes: mean 0.5, unbiased std sqrt(0.25 + 0.25) = 0.7071; the extra
    # row counted would give group 1 mean 2/3 and row 2 (1/3) / 0.5774 = 0.5774
    r = 0.5 / (0.5**0.5 + 1e-6)
    assert torch.allclose(adv, torch.tensor([r, -r, r, -r, r]))
    kl = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5])  # each row keeps its own KL penalty
    adv = A.episode_advantages(rewards, groups, sids, segments, "group_mean", True, kl)
    assert torch.allclose(adv, torch.tensor([r - 0.1, -r - 0.2, r - 0.3, -r - 0.4, r - 0.5]))
    assert torch.equal(A.episode_advantages(rewards[:4], groups[:4], sids[:4], None,
                                            "group_mean", True),
                       A.outcome_advantages(rewards[:4], groups[:4], "group_mean", True))

    B, mask = 5, torch.tensor([[POLICY, ENV, POLICY]] * 5)
    b = RolloutBatch(torch.ones(B, 2, dtype=torch.long), torch.ones(B, 2, dtype=torch.long),
                     torch.ones(B, 3, dtype=torch.long), mask, torch.zeros(B, 3), sids, groups,
                     rewards=rewards, episode_segments=segments,
                     episode_ends=torch.full((B,), ENDS.index("done")))
    stats = global_stats(b, torch.zeros(B, 3), torch.zeros(B, 3), {}, 1)
    assert stats["episodes/done"] == 4 and stats["episodes/new_segments"] == 1
    assert stats["samples"] == 5  # trained: every row
    parts = b.split(2, 2)  # whole groups: the earlier segment goes with group 1
    assert [p.sample_ids.tolist() for p in parts] == [[0, 1], [2, 3, 2]]
    assert b.episode_index().tolist() == [0, 1, 2, 3]
