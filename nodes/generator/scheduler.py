"""The generator's request scheduler: a prompt chunk becomes one engine request per row,
and the completions are reassembled into the chunk's `RolloutBatch` (every request is
built by `engines/requests.py`'s `Requests`, which colocated lock-step ranks use too, and
it assembles the rollout).

A row's tokens do not depend on which rows share the engine's batch, and on the torch
engine they are what `generate` samples for the row (Flattening's, at max_staleness 0). Rows decode
under the engine's own continuous batching; with `generation.continuous_batching` the node
hands over the next chunk's rows while the running chunk's still decode, at most `slots`
rows in the engine at once, and a chunk goes out as soon as its last row ends.

A request the weights' commit aborted (an engine without `keep_on_update`, see
`inflight.py`) is resubmitted as the rest of it (`Requests.rest`).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from contextlib import contextmanager

from nodes.generator.inflight import Span, Weights
from rlhf_async.engines import Completion, GenerationEngine, Request
from rlhf_async.engines.requests import (
    PrefillTally,
    Requests,
    Turned,
    assemble,
    episode_turns,
)
from rlhf_async.modeling.env_calls import env_loop
from rlhf_async.modeling.environment import EpisodeSpec
from rlhf_async.modeling.episodes import Episode, episode_batch, play
from rlhf_async.modeling.generation import SamplingParams
from rlhf_async.modeling.rollout import PromptBatch, RolloutBatch
from rlhf_async.pipeline.protocol import ChunkId


class Scheduler:
    """Chunks over one engine (see the module). `slots`: rows in the engine at once (0 =
    the rows of the first chunk); `None`: no cap (chunks run one at a time)."""

    def __init__(self, engine: GenerationEngine, weights: Weights, params: SamplingParams,
                 seed: int, slots: int | None) -> None:
        self.engine, self.weights, self.params, self.seed = engine, weights, params, seed
        self._slots = slots
        self._rows: asyncio.Semaphore | None = None
        self._submissions = itertools.count()  # a chunk sent again gets its own ids
        self.busy_s = 0.0  # wall time with a chunk in the engine
        self._open, self._since = 0, 0.0

    async def run(self, cid: ChunkId, prompts: PromptBatch) -> tuple[RolloutBatch, Span]:
        """One chunk's rollout and the span of weights it was sampled with."""
        if self._slots is not None and self._rows is None:
            self._rows = asyncio.Semaphore(self._slots or len(prompts))
        with self.busy():
            async with self.weights.chunk() as span:
                requests = self._requests(cid, span)
                done: list[Completion] = []
                try:
                    done = list(await asyncio.gather(*(self._row(requests, sid, r)
                                                       for sid, r in requests.rows(prompts))))
                finally:
                    self.weights.close(span, {v for c in done for v in c.versions})
        batch = assemble(prompts, done, self.params, cid.step, requests.version,
                         self.weights.partial)
        return batch, span

    def _requests(self, cid: ChunkId, span: Span) -> Requests:
        """How the chunk's requests are built, under the weights it starts with (a chunk
        sent again gets ids of its own)."""
        version, lineage = span.held[0]
        return Requests(self.params, self.seed, cid.step,
                        f"{cid.step}.{cid.chunk}.{next(self._submissions)}", version, lineage)

    @contextmanager
    def busy(self) -> Iterator[None]:
        """A chunk generates inside (busy_s counts the time any does)."""
        self._count(+1)
        try:
            yield
        finally:
            self._count(-1)

    def _count(self, delta: int) -> None:
        now = time.perf_counter()
        if self._open:
            self.busy_s += now - self._since
        self._open, self._since = self._open + delta, now

    async def episodes(self, cid: ChunkId, prompts: PromptBatch,
                       spec: EpisodeSpec) -> tuple[RolloutBatch, Span]:
        """One multi-turn episode per row (`modeling.episodes.play`): each policy turn is a
        request per episode still running, its prompt the episode so far (the
        environment's turns are tokens in it, loss mask 0 in the rollout). The environments
        run on the process's environment loop (`env_loop`: one that blocks does not stop
        this node's heartbeats), the requests on this loop."""
        here, tally = asyncio.get_running_loop(), PrefillTally()
        with self.busy():
            async with self.weights.chunk() as span:
                requests = self._requests(cid, span)
                on_here = episode_turns(requests, spec.max_tokens,
                                        lambda sid, r, k: self._row(requests, sid, r, k), tally)

                async def turn(k: int, eps: list[Episode], sids: list[int]) -> Turned:
                    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
                        on_here(k, eps, sids), here))
                try:
                    eps = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
                        play(prompts, self.params, spec, self.seed, cid.step, turn),
                        env_loop().loop))
                finally:
                    self.weights.close(span, {requests.version})
        return tally.onto(episode_batch(prompts, eps, spec.max_tokens, self.params.pad_id,
                                        requests.version, cid.step)), span

    async def _row(self, requests: Requests, sid: int, req: Request,
                   turn: int = 0) -> Completion:
        """One row's completion; under the row cap, when there is one."""
        if self._rows is None:
            return await self._complete(requests, sid, turn, req)
        async with self._rows:
            return await self._complete(requests, sid, turn, req)

    async def _complete(self, requests: Requests, sid: int, turn: int,
                        first: Request) -> Completion:
        """The request, resubmitted as the rest of it after each abort by a commit."""
        total = Completion(first.request_id)
        req = first
        for segment in itertools.count(1):
            await self.weights.steady()
            self.weights.running.add(req.request_id)
            try:
                got = await self.engine.generate(req)
            finally:
                self.weights.running.discard(req.request_id)
            total.token_ids += got.token_ids
            total.logprobs += got.logprobs
            total.versions += got.versions
            total.finish = got.finish
            total.prefill += got.prefill  # each resubmission prefills its prompt again
            if got.finish != "abort" or len(total.token_ids) >= first.max_new_tokens:
                break
            req = requests.rest(first, sid, turn, segment, total)
        if total.finish == "abort":  # cut at its token limit while being aborted
            total.finish = "length"
        return total
