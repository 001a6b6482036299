"""The trainer's admission of a scored chunk (`_accept`): a malformed message is rejected, a
duplicate dropped silently, a chunk of another trainer incarnation's weights or too stale
for `algo.max_staleness` dropped and reported (`ChunkDropped`, so the coordinator sends it
again), the rest kept for its step and reported held (`Received`, so that no other node's
death sends it again). A fake node records counters and events."""

import asyncio
from collections import Counter
from typing import Any

import structlog
import torch

from nodes.trainer.assembler import BatchAssembler
from nodes.trainer.main import _accept
from rlhf_async.modeling.rollout import RolloutBatch
from rlhf_async.pipeline.protocol import (
    SFT_LINEAGE,
    ChunkDropped,
    ChunkId,
    Received,
    rollout_message,
)
from rlhf_async.rl.staleness import StalenessPolicy
from rlhf_async.wire.protocol import Message

OURS = "a1b2c3d4"  # this trainer incarnation's lineage


class FakeTransport:
    def __init__(self) -> None:
        self.spawned: list[Any] = []

    def spawn(self, coro: Any, name: str = "") -> None:
        self.spawned.append(coro)


class FakeNode:
    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()
        self.log = structlog.get_logger()
        self.transport = FakeTransport()
        self.events: list[Any] = []

    async def send_event(self, event: Any, **_: Any) -> None:
        self.events.append(event)

    def sent(self) -> list[Any]:
        """Run what `_accept` spawned; the events it sent."""
        async def drain() -> None:
            for coro in self.transport.spawned:
                await coro
        asyncio.run(drain())
        self.transport.spawned.clear()
        return self.events


def _scored(step: int, chunk: int, chunks: int, version: int, lineage: str,
            first_id: int) -> Message:
    ids = torch.arange(first_id, first_id + 4)
    batch = RolloutBatch(torch.ones(4, 3, dtype=torch.long), torch.ones(4, 3, dtype=torch.long),
                         torch.ones(4, 2, dtype=torch.long), torch.ones(4, 2, dtype=torch.long),
                         torch.zeros(4, 2), ids, ids // 2, version=version, step=step,
                         rewards=torch.zeros(4), ref_logprobs=torch.zeros(4, 2))
    return rollout_message("scored_rollout", ChunkId(step, chunk, chunks), batch, "scorer0",
                           lineage)


def test_fresh_chunks_are_kept_and_counted_as_admitted():
    node, asm, policy = FakeNode(), BatchAssembler(), StalenessPolicy(1)
    assert _accept(node, _scored(0, 0, 2, 0, SFT_LINEAGE, 0), asm, policy, OURS)  # the SFT
    assert _accept(node, _scored(0, 1, 2, 0, OURS, 4), asm, policy, OURS)
    assert asm.waiting() == 2 and asm.pop_ready().sample_ids.tolist() == list(range(8))
    assert policy.admitted == 2 and policy.histogram == {0: 2}
    assert node.sent() == [Received(0, 0, 2), Received(0, 1, 2)] and node.counters == Counter()


def test_a_duplicate_is_dropped_without_asking_for_it_again():
    node, asm, policy = FakeNode(), BatchAssembler(), StalenessPolicy(0)
    assert _accept(node, _scored(0, 0, 1, 0, OURS, 0), asm, policy, OURS)
    assert not _accept(node, _scored(0, 0, 1, 0, OURS, 0), asm, policy, OURS)
    assert node.counters == Counter({"dropped.duplicate": 1})
    assert node.sent() == [Received(0, 0, 1)]  # the first copy's, none for the duplicate
    assert policy.admitted == 1  # the duplicate never reached the staleness rule


def test_a_chunk_too_stale_or_of_another_incarnation_is_dropped_and_asked_for_again():
    node, asm = FakeNode(), BatchAssembler(next_step=3)
    policy = StalenessPolicy(max_staleness=1, publish_every=1)
    # step 3 is generated with version 3 in a synchronous run; k = 1 allows 2 and 3
    assert not _accept(node, _scored(3, 0, 2, 1, OURS, 24), asm, policy, OURS)
    # the SFT lineage is version 0 only: a version 2 under it is another trainer's weights
    assert not _accept(node, _scored(3, 1, 2, 2, SFT_LINEAGE, 28), asm, policy, OURS)
    assert not _accept(node, _scored(3, 1, 2, 2, "deadbeef", 28), asm, policy, OURS)
    assert _accept(node, _scored(3, 1, 2, 2, OURS, 28), asm, policy, OURS)
    assert node.sent() == [ChunkDropped(3, 0, 2, 1), ChunkDropped(3, 1, 2, 2),
                           ChunkDropped(3, 1, 2, 2), Received(3, 1, 2)]
    assert node.counters == Counter({"dropped.stale": 1, "dropped.lineage": 2})
    assert (policy.dropped, policy.admitted, policy.histogram) == (1, 1, {1: 1})
    assert asm.waiting() == 1  # only the admitted chunk waits for its step


def test_a_malformed_message_is_rejected_and_counted_never_fatal():
    node, asm, policy = FakeNode(), BatchAssembler(), StalenessPolicy(0)
    unscored = _scored(0, 0, 1, 0, OURS, 0)
    del unscored.tensors["rewards"]
    no_lineage = _scored(0, 0, 1, 0, OURS, 0)
    del no_lineage.meta["lineage"]
    bad_header = _scored(0, 0, 1, 0, OURS, 0)
    bad_header.meta["chunk"] = 1  # chunk 1 of 1
    for msg in (unscored, no_lineage, bad_header, Message("rollout", meta={})):
        assert not _accept(node, msg, asm, policy, OURS)
    assert node.counters == Counter({"rejected.chunk": 4}) and node.sent() == []
    assert asm.waiting() == 0 and policy.admitted == policy.dropped == 0
