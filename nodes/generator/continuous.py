"""A Separation generator's continuous batching (`generation.continuous_batching`).

One sampling thread runs a `modeling.continuous.ContinuousBatch` for the node's whole life:
the node's loop hands it each chunk as it arrives (`submit`), so the next chunk's prompts
take the slots the running chunk's short answers leave, and a chunk comes back
(`finished`) as soon as its last row ends. The thread is the only one that touches the
weights: between two decode steps, and when idle after a wake-up (`wake`), it copies in
what `InflightWeights` holds staged, so every token records the version that sampled it.

A chunk's span (the weights it was sampled with) opens when it is submitted, so a chunk
waiting for slots while a new trainer incarnation's weights come in is tagged with both
lineages and sent again (as in `inflight.py`).
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import time
from dataclasses import dataclass
from typing import Any

from torch import nn

from nodes.generator.inflight import InflightWeights, Span
from rlhf_async.modeling.continuous import ContinuousBatch
from rlhf_async.modeling.generation import SamplingParams, rollout_batch, sampling_uniforms
from rlhf_async.modeling.rollout import PromptBatch, RolloutBatch
from rlhf_async.strategies.separation.protocol import ChunkId

_WAKE, _STOP = "wake", "stop"


@dataclass
class _Submitted:
    key: int  # the submission's own: a chunk sent again may arrive while it still decodes
    cid: ChunkId
    prompts: PromptBatch
    span: Span


class ContinuousGeneration:
    """The sampling thread (`run`) and the node loop's side of it."""

    def __init__(self, actor: nn.Module, params: SamplingParams, held: InflightWeights,
                 slots: int, seed: int) -> None:
        self.actor, self.params, self.held = actor, params, held
        self.slots, self.seed = slots, seed  # slots 0: the rows of the first chunk
        self._feed: queue.SimpleQueue[_Submitted | str] = queue.SimpleQueue()
        self._done: asyncio.Queue[tuple[ChunkId, RolloutBatch, Span] | BaseException] = \
            asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._keys = itertools.count()
        self.busy_s = 0.0  # the thread's time in decode steps (utilisation)
        self.rows = 0  # rows decoding after the last step

    # --- the node's loop ------------------------------------------------------------------

    def submit(self, cid: ChunkId, prompts: PromptBatch) -> None:
        _, span = self.held.begin()
        self._feed.put(_Submitted(next(self._keys), cid, prompts, span))

    def wake(self) -> None:
        """An update is staged: copy it in at once even if no row decodes."""
        self._feed.put(_WAKE)

    def close(self) -> None:
        """The thread returns after its current step; chunks still decoding are dropped
        (the coordinator sends every chunk not trained again)."""
        self._feed.put(_STOP)

    async def finished(self) -> tuple[ChunkId, RolloutBatch, Span]:
        """The next chunk whose last row ended; raises what stopped the thread."""
        got = await self._done.get()
        if isinstance(got, BaseException):
            raise got
        return got

    # --- the sampling thread --------------------------------------------------------------

    def run(self) -> None:
        try:
            self._run()
        except BaseException as e:  # the node's loop raises it: the node fails, restarts
            self._loop.call_soon_threadsafe(self._done.put_nowait, e)
            raise

    def _run(self) -> None:
        batch: ContinuousBatch | None = None
        open_: dict[int, _Submitted] = {}
        version = self.held.version
        while True:
            for item in self._take(block=batch is None or not batch.busy):
                if item == _STOP:
                    return
                if isinstance(item, _Submitted):
                    if batch is None:
                        batch = ContinuousBatch(self.actor, self.params,
                                                self.slots or len(item.prompts))
                    ids = [int(s) for s in item.prompts.sample_ids]
                    batch.add(item.key, item.prompts, sampling_uniforms(
                        self.seed, item.cid.step, ids, self.params.max_new_tokens))
                    open_[item.key] = item
            if (now := self.held.between()) != version:
                version = now
                if batch is not None:
                    batch.reload()
            if batch is None or not batch.busy:
                continue
            t0 = time.perf_counter()
            handed = batch.step(version)
            self.busy_s += time.perf_counter() - t0
            self.rows = batch.rows
            for key, g in handed:
                sub = open_.pop(key)
                self.held.end(sub.span)
                out = rollout_batch(sub.prompts, g, sub.cid.step, version, partial=True)
                self._loop.call_soon_threadsafe(self._done.put_nowait,
                                                (sub.cid, out, sub.span))

    def _take(self, block: bool) -> list[Any]:
        """What the loop sent since the last step (waiting for something when `block`)."""
        items = [self._feed.get()] if block else []
        while True:
            try:
                items.append(self._feed.get_nowait())
            except queue.Empty:
                return items
