"""Dynamic sampling (`algo.dynamic_sampling`, DAPO: Yu et al. 2025, "DAPO: An Open-Source LLM
Reinforcement Learning System at Scale", section 3.2): a GRPO/RLOO group whose rewards are
all equal has zero advantage and teaches nothing, so it is dropped and the step's batch is
refilled with new groups until it holds `train.prompts_per_step` groups whose rewards vary.

Refills are whole rounds of `prompts_per_step` new prompts (every round has the step's
shapes, so every strategy scores it as it scores a step), at most
`algo.dynamic_sampling_max_tries` of them. The selection is global and ordered: the varied
groups by group id (the step's own groups first, then each round's), and when the rounds
run out before enough vary, the batch is topped up with the earliest dropped groups (their
GRPO/RLOO advantage is zero: they add only their KL term) so every step trains on the same
number of samples. A generated group that is not trained on is counted, never silent:
`dynamic_dropped_groups` in the step's metrics record.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rlhf_async.modeling.collectives import all_gather_1d
from rlhf_async.modeling.rollout import PromptBatch, RolloutBatch

EQUAL = 1e-6  # rewards closer than this count as equal


def group_varies(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """(group ids [G], whether each group's rewards differ [G] bool), groups in the order
    they first appear."""
    ids: list[int] = []
    order: dict[int, int] = {}
    for g in group_ids.tolist():
        if g not in order:
            order[g] = len(ids)
            ids.append(g)
    lo = torch.full((len(ids),), float("inf"))
    hi = torch.full((len(ids),), float("-inf"))
    index = torch.tensor([order[g] for g in group_ids.tolist()], dtype=torch.long)
    r = rewards.detach().float().cpu()
    lo = lo.scatter_reduce(0, index, r, reduce="amin")
    hi = hi.scatter_reduce(0, index, r, reduce="amax")
    return torch.tensor(ids, dtype=torch.long), hi - lo > EQUAL


def select_groups(ids: Tensor, varies: Tensor, wanted: int) -> set[int]:
    """The `wanted` groups a step trains on: varied ones by id, then unvaried ones by id."""
    ranked = sorted(zip(ids.tolist(), varies.tolist(), strict=True),
                    key=lambda x: (not x[1], x[0]))
    return {g for g, _ in ranked[:wanted]}


def dynamic_sample(first: RolloutBatch, refill: Callable[[int], RolloutBatch], wanted: int,
                   max_tries: int) -> tuple[RolloutBatch, dict[str, float]]:
    """This rank's training rows and the step's counts. `first`: this rank's scored share
    of the step; `refill(r)`: this rank's scored share of refill round r (1, 2, ...), every
    rank calling it alike (rounds are decided from global counts). -> (rows of the selected
    groups on this rank, global counts)."""
    batches = [first]
    ids, varies = _global(first)
    while int(varies.sum()) < wanted and len(batches) <= max_tries:
        batches.append(refill(len(batches)))
        more_ids, more_varies = _global(batches[-1])
        ids, varies = torch.cat([ids, more_ids]), torch.cat([varies, more_varies])
    chosen = select_groups(ids, varies, wanted)
    mine = RolloutBatch.concat(batches)
    keep = torch.tensor([int(g) in chosen for g in mine.group_ids.tolist()], dtype=torch.bool)
    kept_varied = min(int(varies.sum()), wanted)
    return mine.select(torch.nonzero(keep).flatten().to(mine.group_ids.device)), {
        "dynamic_refills": float(len(batches) - 1),
        "dynamic_generated_groups": float(len(ids)),
        "dynamic_dropped_groups": float(len(ids) - len(chosen)),
        "dynamic_filled_groups": float(len(chosen) - kept_varied)}


def refill_prompts(make: Callable[[str, int], PromptBatch], steps: int, step: int,
                   round_: int, max_tries: int, group_size: int) -> PromptBatch:
    """Round `round_` (1, 2, ...) of step `step`'s refills: `make(purpose, key)` draws a
    step's worth of prompts (`task.prompt_batch`) under the purpose 'refill', keyed apart
    from the training walk; their sample ids follow every training step's (step * n + i
    for step < `steps`), so their sampling noise is their own."""
    key = step * max_tries + round_ - 1
    p = make("refill", key)
    ids = torch.arange(len(p), dtype=torch.long) + (steps + key) * len(p)
    return PromptBatch(p.prompt_ids, p.prompt_mask, ids, ids // group_size)


def _global(batch: RolloutBatch) -> tuple[Tensor, Tensor]:
    """Every rank's (group ids, varies) of its share, in rank order (= group order)."""
    assert batch.rewards is not None  # a scored batch
    ids, varies = group_varies(batch.rewards, batch.group_ids)
    device = batch.rewards.device  # NCCL gathers tensors on the rank's GPU
    ids = all_gather_1d(ids.to(device)).cpu()
    varies = all_gather_1d(varies.long().to(device)).cpu().bool()
    return ids, varies
