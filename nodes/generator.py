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

import torch

from nodes.common import NodeContext, load_context, message_errors
from rlhf_async.config import weight_sync_backend
from rlhf_async.engines import GenerationBackend, make_generation_backend
from rlhf_async.runtime import Node
from rlhf_async.strategies.separation.events import (
    SFT_LINEAGE,
    Generated,
    Loaded,
    UpdateWeights,
    WeightsApplied,
    WeightSyncConnect,
    WeightSyncFailed,
    decode_command,
    emit,
)
from rlhf_async.strategies.separation.stage import StageClock
from rlhf_async.strategies.separation.wire import prompts_from_message, rollout_message
from rlhf_async.task.pretrain import load_sft
from rlhf_async.weight_sync import GroupSpec, WeightSyncError


async def main(node: Node) -> None:
    job = load_context(node)
    # version 0 = the SFT policy; loaded off the loop so heartbeats go on
    engine = await asyncio.to_thread(_engine, job, int(node.params.get("tensor_parallel", 1)))
    state = {"version": 0, "lineage": SFT_LINEAGE}
    swap = asyncio.Lock()  # held by generation and by the weight swap: one at a time
    received = asyncio.Lock()  # one update in flight: the receiver's staging is reused

    async def connect(payload: dict) -> dict:
        """Join (or re-join under a new epoch) the trainer's broadcast group."""
        cmd = decode_command(WeightSyncConnect.kind, payload)
        spec, rank = GroupSpec.from_dict(cmd.spec), cmd.rank
        async with received:
            await asyncio.to_thread(engine.connect, spec, rank)
        return {"connected": spec.group_name}

    async def update(payload: dict) -> dict:
        cmd = decode_command(UpdateWeights.kind, payload)
        version = cmd.plan.get("version")
        node.transport.spawn(_update(cmd.plan, cmd.lineage), name=f"weights-v{version}")
        return {"receiving": version}

    async def _update(plan: dict, lineage: str) -> None:
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
                state.update(version=version, lineage=lineage)
        except WeightSyncError as e:  # the group broke (a peer died): regrouped and re-sent
            await emit(node, WeightSyncFailed(str(e)))
            return
        await emit(node, WeightsApplied(version, lineage, t1 - t0, time.perf_counter() - t1),
                   weight_version=version)

    node.on_command(WeightSyncConnect.kind, connect)
    node.on_command(UpdateWeights.kind, update)
    await emit(node, Loaded())
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
            version, lineage = state["version"], state["lineage"]
            batch = await clock.busy(node.watchdog.run(
                "generate", job.cfg.runtime.step_deadline_s, asyncio.to_thread(
                    engine.generate, prompts.to(job.device), seed, cid.step, version)))
        await out.send(rollout_message("rollout", cid, batch.to("cpu"), node.node_id, lineage))
        node.info.update(clock.snapshot(), version=version)
        await emit(node, Generated(cid.step, cid.chunk, cid.chunks, version, clock.busy_s,
                                   clock.idle_s), step=cid.step, weight_version=version)


def _engine(job: NodeContext, tensor_parallel: int) -> GenerationBackend:
    """The generation engine over the SFT policy (version 0); torch serves a loaded copy,
    vLLM loads its own over `tensor_parallel` workers."""
    kind = job.cfg.generation.backend
    shadow = job.precision
    actor = shadow.hold("shadow_actor", load_sft(job.art.sft_dir).to(job.device)) \
        if kind == "torch" else None
    return make_generation_backend(kind, str(job.art.sft_dir), job.sampling,
                                   sync_backend=weight_sync_backend(job.cfg), device=job.device,
                                   actor=actor, dtype=shadow.dtype("shadow_actor"),
                                   tensor_parallel=tensor_parallel)
