"""Dynamic sampling (DAPO): which groups vary, the refill count, the global selection and
what is counted, on hand-made batches."""

from __future__ import annotations

import torch

from rlhf_async.modeling.rollout import PromptBatch, RolloutBatch
from rlhf_async.rl.dynamic_sampling import (
    dynamic_sample,
    group_varies,
    refill_prompts,
    select_groups,
)


def _batch(group_ids: list[int], rewards: list[float]) -> RolloutBatch:
    B = len(group_ids)
    g = torch.tensor(group_ids)
    return RolloutBatch(torch.ones(B, 2, dtype=torch.long), torch.ones(B, 2, dtype=torch.long),
                        torch.ones(B, 3, dtype=torch.long), torch.ones(B, 3, dtype=torch.long),
                        torch.zeros(B, 3), g * 2 + torch.arange(B) % 2, g,
                        rewards=torch.tensor(rewards), ref_logprobs=torch.zeros(B, 3))


def test_a_group_varies_when_its_rewards_differ():
    ids, varies = group_varies(torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0]),
                               torch.tensor([7, 7, 3, 3, 9, 9]))
    assert ids.tolist() == [7, 3, 9] and varies.tolist() == [False, True, False]
    # varied first by id, then the unvaried by id
    assert select_groups(torch.tensor([7, 3, 9, 1]), torch.tensor([False, True, False, True]),
                         3) == {1, 3, 7}


def test_refills_until_enough_groups_vary():
    first = _batch([0, 0, 1, 1, 2, 2], [1, 1, 0, 1, 2, 2])  # 1 of 3 groups varies
    rounds = {1: _batch([10, 10, 11, 11, 12, 12], [0, 1, 5, 5, 3, 4]),  # 2 more vary
              2: _batch([20, 20, 21, 21, 22, 22], [0, 1, 0, 1, 0, 1])}
    asked = []

    def refill(r):
        asked.append(r)
        return rounds[r]
    batch, counts = dynamic_sample(first, refill, wanted=3, max_tries=3)
    assert asked == [1]  # 1 + 2 varied groups after one round: enough
    assert batch.group_ids.tolist() == [1, 1, 10, 10, 12, 12]
    assert counts == {"dynamic_refills": 1.0, "dynamic_generated_groups": 6.0,
                      "dynamic_dropped_groups": 3.0, "dynamic_filled_groups": 0.0}


def test_out_of_tries_the_earliest_dropped_groups_fill_the_batch():
    first = _batch([0, 0, 1, 1, 2, 2], [1, 1, 0, 1, 2, 2])
    more = _batch([10, 10, 11, 11, 12, 12], [5, 5, 5, 5, 0, 1])  # 1 more varies: 2 < 3
    batch, counts = dynamic_sample(first, lambda r: more, wanted=3, max_tries=1)
    assert batch.group_ids.tolist() == [0, 0, 1, 1, 12, 12]  # group 0: the earliest dropped
    assert counts == {"dynamic_refills": 1.0, "dynamic_generated_groups": 6.0,
                      "dynamic_dropped_groups": 3.0, "dynamic_filled_groups": 1.0}


def test_no_refill_when_the_step_already_varies():
    first = _batch([0, 0, 1, 1], [0, 1, 1, 0])
    batch, counts = dynamic_sample(first, lambda r: 1 / 0, wanted=2, max_tries=3)
    assert len(batch) == 4 and counts["dynamic_refills"] == 0.0
    assert counts["dynamic_dropped_groups"] == 0.0


def test_refill_prompts_have_sample_ids_past_every_training_step():
    def make(purpose, key):
        assert purpose == "refill"
        ids = torch.arange(key * 4, key * 4 + 4)  # as task.prompt_batch numbers them
        return PromptBatch(torch.ones(4, 2, dtype=torch.long),
                           torch.ones(4, 2, dtype=torch.long), ids, ids // 2)
    # 10 steps of 4 samples: training ids 0..39; step 3, round 2 of at most 3: key 3*3+1
    p = refill_prompts(make, steps=10, step=3, round_=2, max_tries=3, group_size=2)
    assert p.sample_ids.tolist() == [80, 81, 82, 83] and p.group_ids.tolist() == [40, 40, 41,
                                                                                   41]
