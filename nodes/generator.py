"""Generator node: the shadow actor. Pulls prompt chunks, samples responses, pushes rollouts.

Weights arrive by broadcast from the trainer: a background task receives them while this
loop keeps generating, and they are swapped in between two generation steps, never during
one. Every rollout carries the weight version that produced it and the lineage (trainer
incarnation) of those weights; the coordinator learns the new version only after the swap
(the `weights_applied` event).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import torch

from nodes.common import NodeContext, load_context, message_errors
from rlhf_async.config import weight_sync_backend
from rlhf_async.engines import GenerationBackend, make_generation_backend
from rlhf_async.runtime import Node
from rlhf_async.strategies.separation.chunks import prompts_from_message, rollout_message
from rlhf_async.strategies.separation.events import (
    SFT_LINEAGE,
    Connected,
    Generated,
    Loaded,
    Receiving,
    UpdateWeights,
    WeightsApplied,
    WeightSyncConnect,
    WeightSyncFailed,
)
from rlhf_async.strategies.separation.stage import StageClock
from rlhf_async.strategies.training import load_actor
from rlhf_async.weight_sync import WeightSyncError


@dataclass
class Held:
    """The weights generation uses now: their version and lineage (trainer incarnation)."""

    version: int = 0  # the SFT policy
    lineage: str = SFT_LINEAGE


async def main(node: Node) -> None:
    job = load_context(node)
    # version 0 = the SFT policy; loaded off the loop so heartbeats go on
    engine = await asyncio.to_thread(_engine, job, int(node.params.get("tensor_parallel", 1)))
    held = Held()
    swap = asyncio.Lock()  # held by generation and by the weight swap: one at a time
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
            async with swap:
                version = await asyncio.to_thread(engine.swap, staged)
                held.version, held.lineage = version, lineage
        except WeightSyncError as e:  # the group broke (a peer died): regrouped and re-sent
            await node.send_event(WeightSyncFailed(str(e)))
            return
        await node.send_event(WeightsApplied(version, lineage, t1 - t0,
                                             time.perf_counter() - t1), weight_version=version)

    node.handle(WeightSyncConnect, connect)
    node.handle(UpdateWeights, update)
    await node.send_event(Loaded())
    seed = job.cfg.run.seed
    inp, out, clock = node.socket("prompts"), node.socket("rollouts"), StageClock()
    torch.set_grad_enabled(False)
    while not node.stopping:
        await node.wait_resumed()
        msg = await clock.idle(inp.recv())
        try:
            cid, prompts = prompts_from_message(msg)
        except message_errors() as e:
            node.counters["rejected.chunk"] += 1
            node.log.warning("bad_prompt_chunk", error=str(e))
            continue
        async with swap:  # weights cannot change under a generation step
            version, lineage = held.version, held.lineage
            batch = await clock.busy(node.watchdog.run(
                "generate", job.cfg.runtime.step_deadline_s, asyncio.to_thread(
                    engine.generate, prompts.to(job.device), seed, cid.step, version)))
        await out.send(rollout_message("rollout", cid, batch.to("cpu"), node.node_id, lineage))
        node.info.update(clock.snapshot(), version=version)
        await node.send_event(Generated(cid.step, cid.chunk, cid.chunks, version, clock.busy_s,
                                        clock.idle_s), step=cid.step, weight_version=version)


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
