"""Generator node: the shadow actor. Pulls prompt chunks, samples responses, pushes rollouts.

Weights arrive by broadcast from the trainer: a background task receives them while this
loop keeps generating, and they are swapped in between two chunks, never during one; with
`generation.partial_rollout` (torch engine) between two decode steps of the running chunk
instead (`inflight.py`): its rows go on under the new weights, each
token recording its version. Every rollout carries the weight version that produced it (its
oldest token's) and the lineage (trainer incarnation) of those weights; the coordinator
learns the new version only after the swap (the `weights_applied` event).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import torch

from nodes.common.context import NodeContext, load_context, message_errors
from nodes.common.stage import StageClock
from nodes.generator.continuous import ContinuousGeneration
from nodes.generator.inflight import InflightWeights, Span
from rlhf_async.config import weight_sync_backend
from rlhf_async.engines import GenerationBackend, make_generation_backend
from rlhf_async.engines.torch_gen import TorchGenerationBackend
from rlhf_async.modeling.episodes import EnvError
from rlhf_async.modeling.rollout import PromptBatch, RolloutBatch
from rlhf_async.runtime import Node
from rlhf_async.strategies.separation.protocol import (
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
from rlhf_async.strategies.training import load_actor
from rlhf_async.weight_sync import WeightSyncError


async def main(node: Node) -> None:
    job = load_context(node)
    # version 0 = the SFT policy; loaded off the loop so heartbeats go on
    engine = await asyncio.to_thread(_engine, job, int(node.params.get("tensor_parallel", 1)))
    # version 0 = the SFT policy, of lineage SFT; updates queue here until copied in
    held = InflightWeights(engine.swap)
    # partial rollouts: the running chunk takes queued updates between its decode steps
    partial = engine if job.cfg.generation.partial_rollout else None
    if partial is not None and not isinstance(partial, TorchGenerationBackend):
        raise ValueError("generation.partial_rollout needs generation.backend = 'torch'")
    seed = job.cfg.run.seed
    # continuous batching: one sampling thread over the rows of every chunk it holds
    runner = ContinuousGeneration(partial.actor, partial.params, held,
                                  job.cfg.generation.batch_slots, seed) \
        if partial is not None and job.cfg.generation.continuous_batching else None
    swap = asyncio.Lock()  # held by a chunk's generation and by an idle swap: one at a time
    received = asyncio.Lock()  # one update in flight: the receiver's staging is reused

    async def connect(cmd: WeightSyncConnect) -> Connected:
        """Join (or re-join under a new epoch) the trainer's broadcast group."""
        async with received:
            await asyncio.to_thread(engine.connect, cmd.spec, cmd.rank)
        return Connected(cmd.spec.group_name)

    async def update(cmd: UpdateWeights) -> Receiving:
        version = cmd.plan.get("version")
        node.transport.spawn(_update(cmd.plan, cmd.lineage), name=f"weights-v{version}")
        return Receiving(version if isinstance(version, int) else -1)

    async def _update(plan: dict[str, Any], lineage: str) -> None:
        t0 = time.perf_counter()
        try:
            async with received:
                # torch: received here while the current generation step runs; vLLM: its
                # workers receive in the swap (the engine serves one caller at a time)
                staged = await node.watchdog.run(
                    "weight_broadcast", 2 * job.cfg.weight_sync.timeout_s,
                    asyncio.to_thread(engine.stage, plan))
            t1 = time.perf_counter()
            applied = held.offer(staged, lineage)
            # copied in by the running chunk's next decode step (partial rollouts), else
            # once no chunk runs
            node.transport.spawn(_apply_idle(), name="weights-swap")
            version = await asyncio.wrap_future(applied)
        except WeightSyncError as e:  # the group broke (a peer died): regrouped and re-sent
            await node.send_event(WeightSyncFailed(str(e)))
            return
        await node.send_event(WeightsApplied(version, lineage, t1 - t0,
                                             time.perf_counter() - t1), weight_version=version)

    async def _apply_idle() -> None:
        if runner is not None:  # continuous batching: its sampling thread copies it in
            runner.wake()
            return
        async with swap:
            if held.pending:  # else a chunk's decode step took it
                await asyncio.to_thread(held.apply_pending)

    async def ship(cid: ChunkId, batch: RolloutBatch, span: Span) -> None:
        """Send a chunk's rollout on and tell the coordinator."""
        if span.swaps:
            node.counters["partial.interrupted_chunks"] += 1
            node.counters["partial.swaps"] += span.swaps
        version = batch.version  # the oldest token's
        await out.send(rollout_message("rollout", cid, batch.to("cpu"), node.node_id,
                                       span.lineage()))
        node.info.update(clock.snapshot(), version=held.version)
        await node.send_event(Generated(cid.step, cid.chunk, cid.chunks, version, clock.busy_s,
                                        clock.idle_s), step=cid.step, weight_version=version)

    async def chunks() -> AsyncIterator[tuple[ChunkId, PromptBatch]]:
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

    node.handle(WeightSyncConnect, connect)
    node.handle(UpdateWeights, update)
    inp, out, clock = node.socket("prompts"), node.socket("rollouts"), StageClock()
    torch.set_grad_enabled(False)
    await node.send_event(Loaded())
    if runner is not None:
        await _continuous(node, job, runner, chunks(), ship, clock)
        return
    async for cid, prompts in chunks():
        async with swap:  # weights change under a chunk only through `held.between`
            if held.pending:  # published while no chunk ran: in before this one starts
                await asyncio.to_thread(held.apply_pending)
            start, span = held.begin()
            try:
                args = (prompts.to(job.device), seed, cid.step, start)
                work = asyncio.to_thread(engine.generate, *args) if partial is None else \
                    asyncio.to_thread(partial.generate, *args, held.between)
                batch = await clock.busy(node.watchdog.run(
                    "generate", job.cfg.runtime.step_deadline_s, work))
            except EnvError as e:  # the user's environment: the same on any restart
                await fail(node, str(e))
                return
            finally:
                held.end(span)
        await ship(cid, batch, span)


async def _continuous(node: Node, job: NodeContext, runner: ContinuousGeneration,
                      chunks: AsyncIterator[tuple[ChunkId, PromptBatch]],
                      ship: Callable[[ChunkId, RolloutBatch, Span], Awaitable[None]],
                      clock: StageClock) -> None:
    """Continuous batching: chunks go to the sampling thread as they arrive and out as they
    end, each under the step deadline from its arrival."""
    deadline = job.cfg.runtime.step_deadline_s
    # chunk -> the watchdog tokens of its copies in flight (the coordinator may send a
    # chunk again while it still decodes here: each copy goes out once it ends)
    open_: dict[ChunkId, list[int]] = {}
    start = time.perf_counter()

    async def receive() -> None:
        async for cid, prompts in chunks:
            open_.setdefault(cid, []).append(node.watchdog.begin("generate", deadline))
            runner.submit(cid, prompts.to(job.device))

    async def send() -> None:
        while True:
            cid, batch, span = await runner.finished()
            tokens = open_.get(cid, [])
            if tokens:
                node.watchdog.end(tokens.pop(0))
            clock.busy_s, clock.items = runner.busy_s, clock.items + 1
            clock.idle_s = time.perf_counter() - start - runner.busy_s
            await ship(cid, batch, span)

    worker = asyncio.ensure_future(asyncio.to_thread(runner.run))
    tasks = [asyncio.ensure_future(receive()), asyncio.ensure_future(send())]
    try:
        await asyncio.wait([worker, *tasks], return_when=asyncio.FIRST_COMPLETED)
        for t in (worker, *tasks):
            if t.done():
                t.result()  # raise what ended it (the sampling thread's error)
    finally:
        runner.close()
        for t in tasks:
            t.cancel()
        await asyncio.gather(worker, return_exceptions=True)


def _engine(job: NodeContext, tensor_parallel: int) -> GenerationBackend:
    """The generation engine over the SFT policy (version 0); torch serves a loaded copy,
    vLLM loads its own over `tensor_parallel` workers."""
    kind = job.cfg.generation.backend
    shadow = job.precision
    actor = shadow.hold("shadow_actor", load_actor(job.art, job.device)) \
        if kind == "torch" else None
    return make_generation_backend(kind, str(job.art.sft_dir), job.sampling,
                                   sync_backend=weight_sync_backend(job.cfg), device=job.device,
                                   actor=actor, dtype=shadow.dtype("shadow_actor"),
                                   tensor_parallel=tensor_parallel)
