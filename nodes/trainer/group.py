"""The Separation trainer as N data-parallel ranks (torch DDP-style or DeepSpeed ZeRO).

Rank 0 (node "trainer") is the only rank the pipeline sees: it takes the scored chunks,
assembles each step's batch, writes the logs and checkpoints, and broadcasts the weights
to the generators. Ranks 1..N-1 ("trainer1", ...) follow it. Every collective rank 0 runs
(a training step, the walk of the weights a broadcast sends, a checkpoint, the final save)
is first announced to them, with each rank's shard of the step's batch, so that all ranks
run the same collectives in the same order and no rank needs a data queue of its own.
Under ZeRO-3 the broadcast's walk gathers one ~bucket-sized group of parameters at a time
on every rank, and rank 0 sends each group before the next is gathered, so no rank ever
holds the whole model.

A rank that dies takes the group with it: the Driver restarts the other ranks too, the
coordinator hands the new incarnations a new rendezvous, and rank 0 resumes from its
checkpoint, so every prompt is still trained on exactly once.

The rendezvous: the Driver asks rank 0 for a port (`TrainGroupPrepare`) and hands the
address to every rank (`TrainGroupConnect`); each rank builds its learner only then, since
DeepSpeed needs the group to build its engine.
"""

from __future__ import annotations

import collections
import datetime
import enum
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from rlhf_async.engines.process_group import join_group
from rlhf_async.modeling.rollout import RolloutBatch
from rlhf_async.rl.checkpoint import learner_state
from rlhf_async.rl.learner import Learner

# Followers wait in a collective while rank 0 waits for scored chunks, which takes as long
# as generation does; a dead peer is the Driver's to notice (it restarts the whole group).
COLLECTIVE_TIMEOUT = datetime.timedelta(hours=6)


class Op(enum.StrEnum):
    """What rank 0 runs next; the followers run the same."""

    TRAIN = "train"  # one training step on the announced shard
    WEIGHTS = "weights"  # the weights, group by group, for a broadcast (gathered: ZeRO-3)
    CHECKPOINT = "checkpoint"  # the learner state (ZeRO optimizer partitions gathered)
    FINISH = "finish"  # the final policy is saved from the gathered weights; then exit
    STOP = "stop"  # the run stops (rank 0 has checkpointed); exit


class TrainerGroup:
    """This trainer process as `rank` of `world`; with world 1 every call is local."""

    def __init__(self, rank: int, world: int, group_size: int) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"trainer rank {rank} is not in 0..{world - 1}")
        self.rank, self.world, self.group_size = rank, world, group_size

    def join(self, backend: str, addr: str, port: int, join_timeout_s: float) -> None:
        """Join the trainer group (blocking; every rank calls it with the same address)."""
        join_group(backend, addr, port, self.rank, self.world, join_timeout_s=join_timeout_s,
                   timeout=COLLECTIVE_TIMEOUT)

    def lead(self, op: Op, batch: RolloutBatch | None = None,
             detail: Any = None) -> RolloutBatch | None:
        """Rank 0: announce `op` to the followers, each with its shard of `batch` (whole
        groups, cut as Flattening cuts a step's prompts) or else with `detail`; returns
        rank 0's own shard."""
        if self.world == 1:
            return batch
        shards: list[Any] = [detail] * self.world
        if batch is not None:
            shards = batch.split(self.group_size, self.world)
            if len(shards) < self.world:
                raise ValueError(f"a step of {len(batch) // self.group_size} prompt groups "
                                 f"cannot feed {self.world} trainer ranks")
        box: list[Any] = [None]
        dist.scatter_object_list(box, [(op.value, s) for s in shards], src=0)
        return box[0][1]

    def walk_weights(self, learner: Learner, max_bytes: int,
                     use: Callable[[Iterator[dict[str, Tensor]]], None]) -> None:
        """Rank 0: walk the actor's weights ~max_bytes at a time with the followers (under
        ZeRO-3 each group is gathered by all ranks at once) and hand the groups to `use`,
        e.g. a sender's `send`, which finishes with each before it takes the next. The walk
        is completed even when `use` stops early (a failed broadcast), so the followers
        never wait in a gather rank 0 skipped."""
        self.lead(Op.WEIGHTS, detail=max_bytes)
        groups = learner.weight_groups(max_bytes)
        try:
            use(groups)
        finally:
            _join_walk(groups)

    def follow(self, learner: Learner, device: torch.device) -> Op:
        """Ranks 1..N-1: run what rank 0 announces until it says FINISH or STOP."""
        while True:
            box: list[Any] = [None]
            dist.scatter_object_list(box, None, src=0)
            name, shard = box[0]
            op = Op(name)
            if op is Op.TRAIN:
                learner.train_step(shard.to(device))
            elif op is Op.WEIGHTS:  # rank 0's walk, with its group size: the same gathers
                _join_walk(learner.weight_groups(shard))
            elif op is Op.CHECKPOINT:
                learner_state(learner)
            else:
                if op is Op.FINISH:  # the gather is collective: rank 0 saves the policy
                    _join_gather(learner)  # from the whole weights meanwhile
                return op


def _join_walk(groups: Iterator[dict[str, Tensor]]) -> None:
    """Run the rest of a weight walk without using its groups: each step is a collective
    gather under ZeRO-3 that every rank must enter, in the same order."""
    collections.deque(groups, maxlen=0)


def _join_gather(learner: Learner) -> None:
    """Take part in rank 0's gather of the full weights (ZeRO-3; a no-op otherwise)."""
    with learner.actor_backend.gathered():
        return
