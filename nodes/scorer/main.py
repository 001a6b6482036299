"""Scorer node: reward model + reference model (+ a distillation teacher). Adds rewards,
reference log-probs (and the teacher's)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable

import torch

from nodes.common.context import NodeContext, load_context, message_errors
from nodes.common.stage import StageClock
from rlhf_async.engines.sim import SimSpec, current
from rlhf_async.engines.sim.scoring import score_s
from rlhf_async.modeling.models import ScalarHeadModel, freeze
from rlhf_async.modeling.rollout import RolloutBatch
from rlhf_async.pipeline.protocol import (
    Loaded,
    Scored,
    fail,
    lineage_of,
    rollout_from_message,
    rollout_message,
)
from rlhf_async.rl.guards import NonFiniteError
from rlhf_async.rl.scoring import score
from rlhf_async.runtime import Node
from rlhf_async.task import reward_mix
from rlhf_async.task.artefacts import load_reward, load_sft
from rlhf_async.task.rewards.reward_fn import RewardFunctionError
from rlhf_async.task.rewards.teacher import load_teacher, teacher_device


async def main(node: Node) -> None:
    job = await load_context(node)
    reward_model, reference = await asyncio.to_thread(_models, job)  # heartbeats go on
    teacher = await asyncio.to_thread(load_teacher, job.cfg,
                                      teacher_device(job.cfg, job.device, node.node_id),
                                      job.precision)
    task = job.task
    T, mix = job.cfg.generation.temperature, reward_mix(job.cfg, task)
    packed = job.cfg.train.max_tokens_per_microbatch > 0  # the trainer packs: so do we
    inp, out = node.socket("rollouts"), node.socket("scored")
    clock, sim = StageClock(), current()
    torch.set_grad_enabled(False)
    await node.send_event(Loaded())
    while not node.stopping:
        await node.wait_resumed()
        msg = await clock.idle(node.unless_stopped(inp.recv()))
        if msg is None:  # stopped while waiting
            break
        try:
            cid, batch = rollout_from_message(msg, "rollout")
            lineage = lineage_of(msg)
        except message_errors() as e:
            node.counters["rejected.chunk"] += 1
            node.log.warning("bad_rollout", error=str(e))
            continue
        try:
            scored = await clock.busy(node.watchdog.run(
                "score", job.cfg.runtime.step_deadline_s, _timed(sim, asyncio.to_thread(
                    score, reward_model, reference, batch.to(job.device), T, mix, packed,
                    teacher), batch, 1 + (reward_model is not None))))
        except RewardFunctionError as e:  # the user's reward: the same on any restart
            await fail(node, "; ".join(e.problems))
            return
        except NonFiniteError as e:  # a NaN/inf reward: the same on any restart
            await fail(node, str(e))
            return
        await out.send(rollout_message("scored_rollout", cid, scored.to("cpu"), node.node_id,
                                       lineage))
        node.info.update(clock.snapshot())
        await node.send_event(Scored(cid.step, cid.chunk, cid.chunks, clock.busy_s,
                                     clock.idle_s), step=cid.step)


async def _timed(sim: SimSpec | None, scoring: Awaitable[RolloutBatch], batch: RolloutBatch,
                 models: int) -> RolloutBatch:
    """The scored chunk; on simulated GPUs after its forwards' time on them (the stand-in
    models' real forwards inside it)."""
    t0 = time.perf_counter()
    scored = await scoring
    if sim is not None:
        await sim.pause(score_s(sim, batch, models), time.perf_counter() - t0)
    return scored


def _models(job: NodeContext) -> tuple[ScalarHeadModel | None, torch.nn.Module]:
    """(reward model, or None when the task's rule reward replaces it; reference)."""
    rm, hold = load_reward(job.art), job.precision.hold
    # freshly loaded, so frozen in place (a copy would hold each model twice meanwhile)
    return (None if rm is None else hold("reward", freeze(rm).to(job.device)),
            hold("reference", freeze(load_sft(job.art.sft_dir)).to(job.device)))  # type: ignore[arg-type]  # HF's .to overloads
