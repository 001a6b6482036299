"""Generator node: the shadow actor. Pulls prompt chunks, samples responses, pushes rollouts.

A small request scheduler over a generation engine (`generation.backend`, resolved by
`engines.generation_engine`; the request-level interface of `engines/interface.py`): each
chunk's rows become requests (`scheduler.py`), their completions the chunk's rollout.
Weights arrive by broadcast from the trainer: received beside generation (`engine.stage`),
committed between two chunks, or, with `generation.partial_rollout`, while requests run
(`inflight.py`): each token records its version. Every rollout carries the weight version
that produced it (its oldest token's) and the lineage (trainer incarnation) of those
weights; the coordinator learns the new version only after the commit (the
`weights_applied` event).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import torch

from nodes.common.context import NodeContext, load_context, message_errors
from nodes.common.stage import StageClock
from nodes.generator.inflight import Span, Weights
from nodes.generator.scheduler import Scheduler
from rlhf_async.config import weight_sync_backend
from rlhf_async.engines import GenerationEngine, generation_engine, make_engine
from rlhf_async.modeling.compiled_decode import choose as choose_decode
from rlhf_async.modeling.env_calls import EnvError
from rlhf_async.modeling.rollout import PromptBatch, RolloutBatch
from rlhf_async.pipeline.protocol import (
    ChunkId,
    Connected,
    Generated,
    Loaded,
    Receiving,
    UpdateWeights,
    WeightsApplied,
    WeightSyncConnect,
    WeightSyncFailed,
    fail,
    prompts_from_message,
    rollout_message,
)
from rlhf_async.runtime import Node
from rlhf_async.weight_sync import Joins, WeightSyncError


async def main(node: Node) -> None:
    job = await load_context(node)
    choose_decode(job.device, job.cfg.train.steps * job.cfg.generation.max_new_tokens,
                  job.cfg.generation.compile)  # our engine's decode step, compiled or not
    # version 0 = the SFT policy; loaded off the loop so heartbeats go on
    engine = await asyncio.to_thread(_engine, job, int(node.params.get("tensor_parallel", 1)))
    gen = job.cfg.generation
    weights = Weights(engine, partial=gen.partial_rollout)
    # continuous batching: chunks overlap in the engine, at most batch_slots rows of them
    scheduler = Scheduler(engine, weights, job.sampling, job.cfg.run.seed,
                          gen.batch_slots if gen.continuous_batching else None)
    received = asyncio.Lock()  # one update in flight: the receiver's staging is reused
    joins = Joins(received)  # a regroup's epochs: only the newest is joined

    async def connect(cmd: WeightSyncConnect) -> Connected:
        """Join (or re-join under a new epoch) the trainer's broadcast group."""
        await joins.join(cmd.spec, cmd.rank, lambda: engine.connect(cmd.spec, cmd.rank))
        return Connected(cmd.spec.group_name)

    async def update(cmd: UpdateWeights) -> Receiving:
        version = cmd.plan.get("version")
        node.transport.spawn(_update(cmd.plan, cmd.lineage), name=f"weights-v{version}")
        return Receiving(version if isinstance(version, int) else -1)

    async def _update(plan: dict[str, Any], lineage: str) -> None:
        t0 = time.perf_counter()
        try:
            async with received:  # received while requests decode
                staged = await node.watchdog.run(
                    "weight_broadcast", 2 * job.cfg.weight_sync.timeout_s,
                    asyncio.to_thread(engine.stage, plan))
            t1 = time.perf_counter()
            planned = plan.get("version")
            version = await weights.commit(staged, planned if isinstance(planned, int)
                                           else weights.version, lineage)
        except WeightSyncError as e:  # the group broke (a peer died): regrouped and re-sent
            await node.send_event(WeightSyncFailed(str(e)))
            return
        await node.send_event(WeightsApplied(version, lineage, t1 - t0,
                                             time.perf_counter() - t1), weight_version=version)

    async def ship(cid: ChunkId, batch: RolloutBatch, span: Span) -> None:
        """Send a chunk's rollout on and tell the coordinator."""
        if span.swaps:
            node.counters["partial.interrupted_chunks"] += 1
            node.counters["partial.swaps"] += span.swaps
        version = batch.version  # the oldest token's
        await out.send(rollout_message("rollout", cid, batch.to("cpu"), node.node_id,
                                       span.lineage()))
        node.info.update(clock.snapshot(), version=weights.version)
        await node.send_event(Generated(cid.step, cid.chunk, cid.chunks, version, clock.busy_s,
                                        clock.idle_s, batch.episode_error),
                              step=cid.step, weight_version=version)

    async def one(cid: ChunkId, prompts: PromptBatch) -> tuple[RolloutBatch, Span]:
        if job.sampling.episode is None:
            return await scheduler.run(cid, prompts.to(job.device))
        return await scheduler.episodes(cid, prompts.to(job.device), job.sampling.episode)

    async def generate(cid: ChunkId, prompts: PromptBatch) -> None:
        """One chunk (a copy of it: the coordinator may send a chunk again while it still
        decodes here) under the step deadline from its arrival, then out."""
        batch, span = await node.watchdog.run("generate", job.cfg.runtime.step_deadline_s,
                                              one(cid, prompts))
        clock.busy_s, clock.items = scheduler.busy_s, clock.items + 1
        clock.idle_s = time.perf_counter() - started - clock.busy_s
        await ship(cid, batch, span)

    node.handle(WeightSyncConnect, connect)
    node.handle(UpdateWeights, update)
    inp, out, clock = node.socket("prompts"), node.socket("rollouts"), StageClock()
    torch.set_grad_enabled(False)
    started = time.perf_counter()
    await node.send_event(Loaded())
    try:
        if gen.continuous_batching:
            await _overlapping(_chunks(node, inp, clock), generate)
        else:
            async for cid, prompts in _chunks(node, inp, clock):
                await generate(cid, prompts)
    except EnvError as e:  # the user's environment: a restart would only repeat it
        await fail(node, str(e))
    finally:
        await engine.close()


async def _chunks(node: Node, inp: Any, clock: StageClock,
                  ) -> AsyncIterator[tuple[ChunkId, PromptBatch]]:
    """The prompt chunks the coordinator sends, while the node runs."""
    while not node.stopping:
        await node.wait_resumed()
        msg = await clock.idle(node.unless_stopped(inp.recv()))
        if msg is None:  # stopped while waiting
            return
        try:
            got = prompts_from_message(msg)
        except message_errors() as e:
            node.counters["rejected.chunk"] += 1
            node.log.warning("bad_prompt_chunk", error=str(e))
            continue
        yield got


async def _overlapping(chunks: AsyncIterator[tuple[ChunkId, PromptBatch]],
                       generate: Any) -> None:
    """Continuous batching: each chunk generates as it arrives, beside the running ones,
    and goes out as it ends; the first chunk that fails ends the node with its error."""
    running: set[asyncio.Future[None]] = set()
    failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def done(t: asyncio.Future[None]) -> None:
        running.discard(t)
        if not t.cancelled() and t.exception() is not None and not failed.done():
            failed.set_exception(t.exception())  # type: ignore[arg-type]

    async def receive() -> None:
        async for cid, prompts in chunks:
            t = asyncio.ensure_future(generate(cid, prompts))
            running.add(t)
            t.add_done_callback(done)

    feeder = asyncio.ensure_future(receive())
    try:
        await asyncio.wait([feeder, failed], return_when=asyncio.FIRST_COMPLETED)
        if failed.done():
            failed.result()
        feeder.result()
    finally:
        for t in (feeder, *running):
            t.cancel()
        await asyncio.gather(feeder, *running, return_exceptions=True)


def _engine(job: NodeContext, tensor_parallel: int) -> GenerationEngine:
    """The generation engine over the SFT policy (version 0), in the shadow actor's dtype,
    over `tensor_parallel` devices."""
    dtype = str(job.precision.dtype("shadow_actor")).removeprefix("torch.")
    return make_engine(generation_engine(job.cfg), str(job.art.sft_dir), job.sampling,
                       dtype=dtype, tensor_parallel=tensor_parallel,
                       sync_backend=weight_sync_backend(job.cfg), device=job.device,
                       # only an episode's next turn continues a finished request: single
                       # responses would pay a copy of every row's KV for nothing
                       prefix_cache_mb=job.cfg.generation.prefix_cache_mb
                       if job.sampling.episode is not None else 0)
