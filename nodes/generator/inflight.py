"""The weights a Separation generator's engine serves, and how updates reach it.

An update is received beside generation (`engine.stage`, in a thread), then committed
(`engine.commit`) at a point that depends on the job:

- without `generation.partial_rollout`: between two chunks, never during one (a chunk holds
  `chunk()`; a commit waits for it);
- with it, on an engine that keeps running requests across an update
  (`capabilities.keep_on_update`): at once, at the engine's next decode boundary; the
  running requests go on under the new weights, each token recording its version;
- with it, on an engine that cannot: the running requests are aborted, the update
  committed, and each request resubmitted with the tokens it generated as prompt
  (`Scheduler` in `scheduler.py` does the resubmitting; it waits on `steady()`).

A chunk spans the weights it started with and every update whose tokens it holds (`Span`).
Its rollout's `version` is its oldest token's, so `algo.max_staleness` bounds the oldest
token. Its lineage (the trainer incarnation of the weights) must be one: a chunk with
tokens of two trainer incarnations is tagged with both, which no trainer owns, so the
trainer drops it and the coordinator sends it again. Version 0 is the SFT policy in every
lineage.

At `algo.max_staleness = 0` nothing is ever committed mid-chunk: a chunk of step s goes out
only once version s // publish_every is held, and the next version needs step s trained,
i.e. this very chunk; so the trajectory is the synchronous one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from rlhf_async.engines import GenerationEngine
from rlhf_async.pipeline.protocol import SFT_LINEAGE


@dataclass
class Span:
    """The weights (version, lineage) one chunk was sampled with, oldest first."""

    held: list[tuple[int, str]] = field(default_factory=list)
    # updates committed while the chunk was open: in `held` once its tokens show them
    offered: list[tuple[int, str]] = field(default_factory=list)

    def lineage(self) -> str:
        """The lineage the chunk's weights share, else the one trainer lineage of those
        past version 0 (SFT_LINEAGE if none); several joined with '+' (no trainer's: the
        chunk is dropped and re-sent)."""
        if len({lin for _, lin in self.held}) == 1:
            return self.held[0][1]
        names = sorted({lin for v, lin in self.held if v != 0 and lin != SFT_LINEAGE})
        return "+".join(names) if names else SFT_LINEAGE

    @property
    def swaps(self) -> int:
        return len(self.held) - 1

    def settle(self, versions: set[int]) -> None:
        """The chunk ended with tokens of `versions`: the updates it took are those of
        its offered ones whose version its tokens carry (a version number that two
        lineages share counts for both: the chunk is then re-sent)."""
        for got in self.offered:
            if got[0] in versions and got not in self.held:
                self.held.append(got)
        self.offered = []


class Weights:
    """The (version, lineage) an engine serves and the commits of staged updates."""

    def __init__(self, engine: GenerationEngine, *, partial: bool) -> None:
        self.engine = engine
        self.version, self.lineage = engine.version, SFT_LINEAGE
        self.partial = partial  # commit while chunks run (generation.partial_rollout)
        self._chunks = asyncio.Lock()  # without partial rollouts: a chunk, or a commit
        self._commit = asyncio.Lock()  # one commit at a time, in the order staged
        self._steady = asyncio.Event()  # cleared while running requests are aborted
        self._steady.set()
        self._spans: list[Span] = []
        self._committing: tuple[int, str] | None = None
        self.running: set[str] = set()  # request ids in the engine (the scheduler's)

    @asynccontextmanager
    async def chunk(self) -> AsyncIterator[Span]:
        """A chunk generates inside: its span, open until it ends."""
        if self.partial:
            yield self._open()
            return
        async with self._chunks:
            yield self._open()

    def _open(self) -> Span:
        span = Span([(self.version, self.lineage)])
        if self._committing is not None:  # its tokens may come from the update going in
            span.offered.append(self._committing)
        self._spans.append(span)
        return span

    def close(self, span: Span, versions: set[int]) -> None:
        self._spans = [s for s in self._spans if s is not span]
        span.settle(versions)

    async def steady(self) -> None:
        """Wait until no abort-and-commit is going on (before a request is submitted)."""
        await self._steady.wait()

    async def commit(self, staged: Any, version: int, lineage: str) -> int:
        """Apply a staged update (of `version`, the plan's) where the job allows (see the
        module); the version held after it. A failed commit raises and keeps the weights
        as they were."""
        async with self._commit:
            if self.partial:
                return await self._apply(staged, version, lineage)
            async with self._chunks:
                return await self._apply(staged, version, lineage)

    async def _apply(self, staged: Any, planned: int, lineage: str) -> int:
        keep = self.engine.capabilities.keep_on_update
        aborting = self.partial and not keep and bool(self.running)
        if aborting:
            self._steady.clear()
            await asyncio.gather(*(self.engine.abort(r) for r in list(self.running)))
        try:
            self._committing = (planned, lineage)
            for span in self._spans:
                span.offered.append(self._committing)
            version = await self.engine.commit(staged)
            if (version, lineage) != self._committing:  # the engine says what it holds
                for span in self._spans:
                    span.offered.append((version, lineage))
            self.version, self.lineage = version, lineage
            return version
        finally:
            self._committing = None
            self._steady.set()

