"""In-flight weight updates of a Separation generator (`generation.partial_rollout`).

Without partial rollouts a generator swaps staged weights between two whole chunks. With
them, a staged update is offered here and taken at the next decode step of the running
chunk (`between`, called by the sampling thread), or, when no chunk is running, by the
node's idle path (`apply_pending` under the generator's swap lock). Either way the weights
are copied in on one thread while no forward runs, in the order they were published, and
each offer's future resolves to the version now held, so the node acknowledges it
(`WeightsApplied`) as soon as it is in: the coordinator's dispatch gate then sees what the
generator holds even while a long chunk is still decoding.

A chunk spans the weights it started with and every update taken during it (`Span`). Its
rollout's `version` is its oldest token's (`generation.generate`), so `algo.max_staleness`
bounds the oldest token. Its lineage (the trainer incarnation of the weights) must be one:
a chunk that took weights of two trainer incarnations is tagged with both, which no
trainer owns, so the trainer drops it and the coordinator sends it again. Version 0 is the
SFT policy in every lineage.

At `algo.max_staleness = 0` nothing is ever taken mid-chunk: a chunk of step s goes out
only once version s // publish_every is held, and the next version needs step s trained,
i.e. this very chunk; so the trajectory is the synchronous one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from rlhf_async.strategies.separation.protocol import SFT_LINEAGE


@dataclass
class Span:
    """The weights (version, lineage) one chunk was sampled with, oldest first."""

    held: list[tuple[int, str]] = field(default_factory=list)

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


class InflightWeights:
    """Staged updates waiting for the next decode step, and the weights held now."""

    def __init__(self, swap: Callable[[Any], int], version: int = 0,
                 lineage: str = SFT_LINEAGE) -> None:
        self._swap = swap  # copies staged weights into the engine's module -> their version
        self._mu = threading.Lock()  # one copier at a time; guards everything below
        self._pending: list[tuple[Any, str, Future[int]]] = []
        self.version, self.lineage = version, lineage
        self._spans: list[Span] = []  # the running chunks', between begin and end

    def offer(self, staged: Any, lineage: str) -> Future[int]:
        """Queue a staged update; the future gives its version once it is in."""
        fut: Future[int] = Future()
        with self._mu:
            self._pending.append((staged, lineage, fut))
        return fut

    def apply_pending(self) -> int:
        """Copy in every queued update, oldest first; the version held after them. An
        update that fails resolves its future with the error (the weights stay as they
        were: `load_into_module` checks before it copies)."""
        with self._mu:
            pending, self._pending = self._pending, []
            for staged, lineage, fut in pending:
                try:
                    version = self._swap(staged)
                except Exception as e:
                    fut.set_exception(e)
                    continue
                self.version, self.lineage = version, lineage
                for span in self._spans:
                    span.held.append((version, lineage))
                fut.set_result(version)
            return self.version

    def begin(self) -> tuple[int, Span]:
        """A chunk starts (on the node's loop, before its sampling thread): the version it
        starts with and the span its updates are recorded in. With continuous batching
        several chunks are open at once."""
        with self._mu:
            span = Span([(self.version, self.lineage)])
            self._spans.append(span)
            return self.version, span

    def end(self, span: Span) -> None:
        with self._mu:
            self._spans = [s for s in self._spans if s is not span]

    @property
    def pending(self) -> bool:
        """Whether an update waits to be copied in."""
        return bool(self._pending)

    def between(self) -> int:
        """The sampling thread's hook between two decode steps."""
        if not self._pending:  # read without the lock: a miss is taken at the next step
            return self.version
        return self.apply_pending()
