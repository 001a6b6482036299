"""The trainer's ranks as one group, node side, without a second process: one rank is no
group (every call is local), and a step is shared out in whole prompt groups."""

import pytest
import torch

from nodes.trainer.group import Op, TrainerGroup
from rlhf_async.modeling.rollout import RolloutBatch


def _batch(groups: int, g: int = 2) -> RolloutBatch:
    n = groups * g
    return RolloutBatch(torch.zeros(n, 3, dtype=torch.long), torch.ones(n, 3, dtype=torch.long),
                        torch.zeros(n, 4, dtype=torch.long), torch.ones(n, 4, dtype=torch.long),
                        torch.zeros(n, 4), torch.arange(n), torch.arange(n) // g)


def test_a_step_is_shared_out_in_whole_groups_and_one_rank_keeps_it_all():
    parts = _batch(5).split(2, 2)
    assert [p.group_ids.tolist() for p in parts] == [[0, 0, 1, 1], [2, 2, 3, 3, 4, 4]]
    solo = TrainerGroup(0, 1, 2)
    b = _batch(3)
    assert solo.lead(Op.TRAIN, b) is b  # no collective without peers
    with pytest.raises(ValueError, match="trainer rank 2 is not in 0..1"):
        TrainerGroup(2, 2, 2)


def test_alone_a_weight_walk_hands_every_group_to_its_user_and_finishes_it():
    class Learner:
        def __init__(self) -> None:
            self.walked: list[int] = []

        def weight_groups(self, max_bytes: int):
            for i in range(3):
                self.walked.append(i)
                yield {f"w{i}": torch.zeros(max_bytes // 4)}

    solo, learner = TrainerGroup(0, 1, 2), Learner()
    got: list[list[str]] = []

    def use_first_only(groups):  # a send that fails after its first bucket
        got.append(list(next(groups)))
    solo.walk_weights(learner, 64, use_first_only)  # type: ignore[arg-type]
    # the walk was completed anyway: under ZeRO-3 each group is a gather every rank enters
    assert got == [["w0"]] and learner.walked == [0, 1, 2]
