"""The generator's continuous-batching loop (`_continuous`): each chunk that arrives goes to
the sampling thread and out once it ends, each copy under its own step deadline (a chunk
the coordinator re-sent while it still decodes goes out twice, its deadlines closed in
arrival order), and an error of the sampling thread ends the node with it. The sampling
thread and the node are fakes."""

import asyncio
import threading
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from nodes.common.stage import StageClock
from nodes.generator.inflight import Span
from nodes.generator.main import _continuous
from rlhf_async.modeling.rollout import PromptBatch, RolloutBatch
from rlhf_async.strategies.separation.protocol import ChunkId


def _prompts(first: int) -> PromptBatch:
    ids = torch.arange(first, first + 2)
    return PromptBatch(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long),
                       ids, ids // 2)


def _rollout(p: PromptBatch) -> RolloutBatch:
    return RolloutBatch(p.prompt_ids, p.prompt_mask, torch.ones(2, 1, dtype=torch.long),
                        torch.ones(2, 1, dtype=torch.long), torch.zeros(2, 1), p.sample_ids,
                        p.group_ids)


class FakeRunner:
    """A sampling thread that ends chunks in the order the test scripts; `run` blocks like
    the real thread until `close` (or fails with `error` once every chunk is out)."""

    def __init__(self, order: list[ChunkId], error: Exception | None = None) -> None:
        self.order, self.error = order, error
        self.submitted: list[ChunkId] = []
        self.prompts: dict[ChunkId, PromptBatch] = {}
        self.busy_s = 0.0
        self.closed = threading.Event()
        self.out: asyncio.Queue[ChunkId] = asyncio.Queue()
        self.loop = asyncio.get_running_loop()

    def submit(self, cid: ChunkId, prompts: PromptBatch) -> None:
        self.submitted.append(cid)
        self.prompts[cid] = prompts
        if len(self.submitted) == len(self.order):  # all in: end them in the scripted order
            for c in self.order:
                self.out.put_nowait(c)

    async def finished(self) -> tuple[ChunkId, RolloutBatch, Span]:
        cid = await self.out.get()
        self.busy_s += 0.5  # each chunk's decode steps
        if self.out.empty() and self.error is not None:
            self.closed.set()
        return cid, _rollout(self.prompts[cid]), Span(0)

    def run(self) -> None:
        self.closed.wait(timeout=60)
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self.closed.set()


class FakeWatchdog:
    def __init__(self) -> None:
        self.tokens = iter(range(100))
        self.open: dict[int, tuple[str, float]] = {}
        self.ended: list[int] = []

    def begin(self, name: str, deadline: float) -> int:
        token = next(self.tokens)
        self.open[token] = (name, deadline)
        return token

    def end(self, token: int) -> None:
        del self.open[token]
        self.ended.append(token)


A, B = ChunkId(0, 0, 2), ChunkId(0, 1, 2)
JOB = SimpleNamespace(cfg=SimpleNamespace(runtime=SimpleNamespace(step_deadline_s=30.0)),
                      device=torch.device("cpu"))


def _drive(order: list[ChunkId], arrivals: list[ChunkId], error: Exception | None = None
           ) -> tuple[list[Any], FakeRunner, FakeWatchdog, StageClock]:
    node = SimpleNamespace(watchdog=FakeWatchdog())
    shipped: list[Any] = []
    clock = StageClock()

    async def main() -> FakeRunner:
        runner, stopping = FakeRunner(order, error), asyncio.Event()

        async def chunks() -> AsyncIterator[tuple[ChunkId, PromptBatch]]:
            for cid in arrivals:
                yield cid, _prompts(2 * cid.chunk)
            await stopping.wait()  # no more chunks come; the node's queue ends at its stop

        async def ship(cid: ChunkId, batch: RolloutBatch, span: Span) -> None:
            shipped.append((cid, batch.sample_ids.tolist(), node.watchdog.ended[:]))
            if len(shipped) == len(order) and error is None:
                stopping.set()  # the node is stopped once everything went out
        await _continuous(node, JOB, runner, chunks(), ship, clock)  # type: ignore[arg-type]
        return runner
    return shipped, asyncio.run(main()), node.watchdog, clock


def test_chunks_go_out_as_they_end_each_copy_under_its_own_deadline():
    # B ends first; A was sent twice (its first copy is still decoding when it comes again)
    shipped, runner, watchdog, clock = _drive([B, A, A], [A, B, A])
    assert runner.submitted == [A, B, A]
    # tokens 0 (A), 1 (B), 2 (A's second copy): B's closes first, then A's in order
    assert shipped == [(B, [2, 3], [1]), (A, [0, 1], [1, 0]), (A, [0, 1], [1, 0, 2])]
    assert watchdog.open == {}
    assert clock.items == 3 and clock.busy_s == 1.5  # the sampling thread's time


def test_an_error_of_the_sampling_thread_ends_the_node_with_it():
    with pytest.raises(RuntimeError, match="CUDA error: out of memory"):
        _drive([A], [A], error=RuntimeError("CUDA error: out of memory"))
