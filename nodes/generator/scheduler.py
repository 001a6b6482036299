"""The generator's request scheduler: a prompt chunk becomes one engine request per row,
and the completions are reassembled into the chunk's `RolloutBatch` (the requests and the
assembly are `engines/requests.py`'s, which colocated lock-step ranks use too).

Each row's request is keyed by `request_seed(run seed, step, sample id, segment)`, so its
tokens do not depend on which rows share the engine's batch, and on the torch engine they
are what `generate` samples for the row (Flattening's, at max_staleness 0). Rows decode
under the engine's own continuous batching; with `generation.continuous_batching` the node
hands over the next chunk's rows while the running chunk's still decode, at most `slots`
rows in the engine at once, and a chunk goes out as soon as its last row ends.

A request the weights' commit aborted (an engine without `keep_on_update`, see
`inflight.py`) is resubmitted with the tokens it generated appended to its prompt, for the
tokens it has left, keyed by the next segment (a resubmitted request restarts its RNG).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from contextlib import contextmanager

from nodes.generator.inflight import Span, Weights
from rlhf_async.engines import Completion, GenerationEngine, Request
from rlhf_async.engines.requests import PrefillTally, assemble, chunk_requests, turn_request
from rlhf_async.modeling.env_calls import env_loop
from rlhf_async.modeling.environment import EpisodeSpec
from rlhf_async.modeling.episodes import Episode, episode_batch, play
from rlhf_async.modeling.generation import SamplingParams, request_seed
from rlhf_async.modeling.rollout import PromptBatch, RolloutBatch
from rlhf_async.strategies.separation.protocol import ChunkId


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
                start = span.held[0]
                tag = f"{cid.step}.{cid.chunk}.{next(self._submissions)}"
                reqs = chunk_requests(prompts, self.params, self.seed, cid.step, tag,
                                      f"{start[1]}:{start[0]}")
                done: list[Completion] = []
                try:
                    done = list(await asyncio.gather(*(self._row(sid, cid.step, r)
                                                       for sid, r in reqs)))
                finally:
                    self.weights.close(span, {v for c in done for v in c.versions})
        batch = assemble(prompts, done, self.params, cid.step, start[0],
                         self.weights.partial)
        return batch, span

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
        p, E = self.params, spec.max_tokens
        here, tally = asyncio.get_running_loop(), PrefillTally()
        with self.busy():
            async with self.weights.chunk() as span:
                start = span.held[0]
                tag = f"{cid.step}.{cid.chunk}.{next(self._submissions)}"

                async def requests(k: int, eps: list[Episode], sids: list[int],
                                   ) -> list[tuple[list[int], list[float], bool]]:
                    reqs = [turn_request(tag, k, e, sid, p, E, self.seed, cid.step,
                                         f"{start[1]}:{start[0]}")
                            for e, sid in zip(eps, sids, strict=True)]
                    done = await asyncio.gather(*(self._row(sid, cid.step, r, k)
                                                  for sid, r in zip(sids, reqs, strict=True)))
                    tally.add(sids, done)
                    return [(c.token_ids, c.logprobs, c.finish == "stop") for c in done]

                async def turn(k: int, eps: list[Episode], sids: list[int],
                               ) -> list[tuple[list[int], list[float], bool]]:
                    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
                        requests(k, eps, sids), here))
                try:
                    eps = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
                        play(prompts, p, spec, self.seed, cid.step, turn), env_loop().loop))
                finally:
                    self.weights.close(span, {start[0]})
        return tally.onto(episode_batch(prompts, eps, E, p.pad_id, start[0], cid.step)), span

    async def _row(self, sid: int, step: int, req: Request, turn: int = 0) -> Completion:
        """One row's completion; under the row cap, when there is one."""
        if self._rows is None:
            return await self._complete(sid, step, turn, req)
        async with self._rows:
            return await self._complete(sid, step, turn, req)

    async def _complete(self, sid: int, step: int, turn: int, first: Request) -> Completion:
        """The request, resubmitted with what it generated after each abort by a commit."""
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
            left = first.max_new_tokens - len(total.token_ids)
            if got.finish != "abort" or left <= 0:
                break
            req = Request(f"{first.request_id}#{segment}",
                          first.prompt_ids + tuple(total.token_ids), left,
                          request_seed(self.seed, step, sid, segment, turn),
                          max(0, first.min_new_tokens - len(total.token_ids)),
                          first.stop_ids, first.stop_strings, first.cache_salt)
        if total.finish == "abort":  # cut at its token limit while being aborted
            total.finish = "length"
        return total

