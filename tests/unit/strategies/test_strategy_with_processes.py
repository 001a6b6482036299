"""A placement strategy that runs its own processes is this file plus one registry line.

The toy `tandem`, written here alone: a `learner` process (actor, critic) and a `sampler`
process (a copy of the actor, reward, reference), both started and supervised by the real
coordinator (control/), forked from the fork server that preloaded this module
(`fork_preload`). Each step the sampler generates and scores the step's prompts and sends
the scored rollout to the learner (the pipeline protocol's data message); the learner
trains on it, sends the new weights back, and reports `Trained`; the coordinator side
writes the metrics record. Synchronous (the sampler waits for each step's weights), so it
trains the very trajectory Flattening trains.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nodes.common.context import NodeContext, load_context
from rlhf_async.cli import main
from rlhf_async.config import JobConfig, PlacementConfig, load_config, to_dict
from rlhf_async.config.presets import Recipe
from rlhf_async.job import run
from rlhf_async.metrics import MetricsWriter, read_metrics
from rlhf_async.modeling.episodes import rollout
from rlhf_async.modeling.rollout import PromptBatch, RolloutBatch
from rlhf_async.pipeline.protocol import (
    SFT_LINEAGE,
    ChunkId,
    Done,
    Failed,
    NodeDead,
    Trained,
    WeightSync,
    decode_event,
    rollout_from_message,
    rollout_message,
)
from rlhf_async.pipeline.training import build_learner, save_final_policy, step_record
from rlhf_async.runtime import Node, NodeSpec, run_loop
from rlhf_async.runtime.ipc_dir import make_ipc_dir
from rlhf_async.runtime.launcher import LocalLauncher
from rlhf_async.strategies import registry
from rlhf_async.strategies.base import (
    JobStopped,
    Overrides,
    RunFailed,
    RunResult,
    Strategy,
    job_coordinator,
)
from rlhf_async.strategies.flattening import full_scorer
from rlhf_async.strategies.lockstep import Scorer
from rlhf_async.strategies.placement import (
    INFER,
    TRAIN,
    Placement,
    ProcessPlacement,
    engine_problems,
    model_placement,
)
from rlhf_async.strategies.pricing import Pricing, in_turn
from rlhf_async.task.artefacts import Artefacts, load_sft
from rlhf_async.wire.protocol import Message, register_kind
from rlhf_async.wire.transport import Endpoint

NAME = "tandem"


class TandemFailed(RunFailed):
    """The run cannot go on: the command line says why in one line."""
WEIGHTS = register_kind("tandem_weights")  # the learner's actor, after each step
REPO = Path(__file__).resolve().parents[3]


# ---- the node programs (run in the processes the coordinator starts) ---------------------

async def learner(node: Node) -> None:
    job = await load_context(node)
    cfg, steps = job.cfg, job.cfg.train.steps
    learner = await asyncio.to_thread(build_learner, cfg, job.art, job.device, job.precision)
    rollouts, weights = node.socket("rollouts"), node.socket("weights")
    for step in range(steps):
        t0 = time.perf_counter()
        cid, batch = rollout_from_message(await rollouts.recv(), "scored_rollout")
        assert cid.step == step, (cid, step)
        metrics = await asyncio.to_thread(learner.train_step, batch.to(job.device))
        busy = time.perf_counter() - t0
        await weights.send(Message(WEIGHTS, meta={"version": learner.version},
                                   tensors={k: v.detach().cpu().contiguous()
                                            for k, v in learner.actor.state_dict().items()}))
        await node.send_event(Trained(
            step=step, metrics=metrics, sample_ids=batch.sample_ids.tolist(),
            rollout_version=batch.version, queue_trainer=0, weight_sync=WeightSync(),
            busy_s=busy, idle_s=0.0), step=step, weight_version=learner.version)
    policy_dir = Path(node.params["policy_dir"])
    await asyncio.to_thread(save_final_policy, cfg, learner, policy_dir, NAME)
    await node.send_event(Done(str(policy_dir), steps))
    await node.wait_stop()


async def sampler(node: Node) -> None:
    job = await load_context(node)
    cfg, device = job.cfg, job.device
    actor = load_sft(job.art.sft_dir).to(device)  # type: ignore[arg-type]
    score = full_scorer(cfg, job.art, job.task, actor, 0, 1, device, job.precision)
    rollouts, weights = node.socket("rollouts"), node.socket("weights")
    G, version = cfg.algo.group_size, 0
    for step in range(cfg.train.steps):
        prompts = job.task.prompt_batch(cfg.run.seed, "train", step,
                                        cfg.train.prompts_per_step, G).to(device)
        batch = await asyncio.to_thread(_sample, actor, score, prompts, job, step, version)
        await rollouts.send(rollout_message("scored_rollout", ChunkId(step, 0, 1), batch,
                                            node.node_id, SFT_LINEAGE))
        msg = await weights.recv()  # on-policy: the next step samples the trained weights
        actor.load_state_dict(msg.tensors)
        version = int(msg.meta["version"])
    await node.wait_stop()


def _sample(actor: torch.nn.Module, score: Scorer, prompts: PromptBatch, job: NodeContext,
            step: int, version: int) -> RolloutBatch:
    return score(rollout(actor, prompts, job.sampling, job.cfg.run.seed, step, version))


# ---- the strategy: preset, checks, runner (the coordinator side) -------------------------

def preset(cfg: PlacementConfig, recipe: Recipe, over: Overrides) -> Placement:
    train = ("actor", "critic") if recipe.has_critic else ("actor",)
    infer = ("shadow_actor", "reward", "reference")
    last = (cfg.devices - 1,)
    return Placement(NAME, cfg.device, cfg.devices, (
        ProcessPlacement("learner", "learner", train, (0,), TRAIN),
        ProcessPlacement("sampler", "sampler", infer, last, INFER)),
        tuple(model_placement(cfg, m, (0,), TRAIN, over) for m in train)
        + tuple(model_placement(cfg, m, last, INFER, over) for m in infer))


def runner_problems(cfg: JobConfig, p: Placement) -> list[str]:
    out = engine_problems(p)
    if cfg.placement.device != "cpu":
        out.append(f"placement.device: {NAME} runs on cpu only")
    return out


async def _drive(cfg: JobConfig, placement: Placement, art: Artefacts, run_dir: Path,
                 sock: str) -> RunResult:
    params = {"config": to_dict(cfg), "sft_dir": str(art.sft_dir),
              "rm_dir": "" if art.rm_dir is None else str(art.rm_dir),
              "policy_dir": str(run_dir / "policy"),
              "precision": placement.precision().to_dict()}
    specs = [NodeSpec("learner", "learner", f"{__name__}:learner", {
        "rollouts": Endpoint("pull", f"ipc://{sock}/rollouts", bind=True),
        "weights": Endpoint("push", f"ipc://{sock}/weights")}, params,
        num_threads=cfg.placement.cpu_threads),
        NodeSpec("sampler", "sampler", f"{__name__}:sampler", {
            "rollouts": Endpoint("push", f"ipc://{sock}/rollouts"),
            "weights": Endpoint("pull", f"ipc://{sock}/weights", bind=True)}, params,
            num_threads=cfg.placement.cpu_threads)]
    launcher = LocalLauncher(start=cfg.runtime.node_start, preload=STRATEGY.fork_preload)
    async with job_coordinator(cfg, run_dir, launcher) as coord:
        writer = MetricsWriter(run_dir / "metrics.jsonl")
        with coord.events() as events:
            await coord.launch(specs)

            async def until_done() -> RunResult:
                t0 = last = time.perf_counter()
                async for raw in events:
                    match decode_event(raw):
                        case Trained() as t:
                            now = time.perf_counter()
                            writer.write(step_record(t.step, t.metrics, now - last,
                                                     rollout_version=t.rollout_version))
                            last = now
                        case Done(policy_dir=policy):
                            return RunResult(writer.path, Path(policy), last - t0)
                        case NodeDead(reason=why) | Failed(error=why):
                            raise TandemFailed(f"{raw.node_id}: {why}")
                raise AssertionError("the event stream does not end")
            try:
                result = await coord.run_until_stop(until_done())
            finally:
                writer.close()
    if result is None:
        raise JobStopped(coord.stop_reason)
    return result


def run_tandem(cfg: JobConfig, placement: Placement, art: Artefacts, run_dir: Path,
               start_step: int = 0) -> RunResult:
    if start_step:
        raise RuntimeError(f"{NAME} keeps no checkpoint to resume step {start_step} from")
    sock = make_ipc_dir()
    try:
        return run_loop(_drive(cfg, placement, art, run_dir.resolve(), sock))
    finally:
        shutil.rmtree(sock, ignore_errors=True)


STRATEGY = Strategy(
    name=NAME, summary="a learner process and a sampler process, in turn",
    roles=("learner", "sampler"), preset=preset, placement_problems=lambda cfg, p: [],
    runner_problems=runner_problems, run=run_tandem, pricing=Pricing(step=in_turn),
    fork_preload=(__name__,))


# ---- the test ----------------------------------------------------------------------------

TINY = ["model.hidden=32", "model.layers=1", "model.heads=2", "sft.steps=20",
        "reward_model.steps=20", "reward_model.heldout_pairs=64", "run.eval_prompts=16",
        "train.steps=3", "train.prompts_per_step=8", "algo.group_size=2", "run.plot=false",
        "run.progress=false", "algo.name=grpo"]


@pytest.mark.timeout(120)
def test_a_strategy_with_its_own_processes_is_one_module_and_one_registry_line(
        tmp_path, cache, monkeypatch, one_thread):
    monkeypatch.setitem(registry.STRATEGIES, NAME, STRATEGY)  # the line
    base = [*TINY, f"run.cache_dir={json.dumps(str(cache))}",
            f"run.output_dir={json.dumps(str(tmp_path))}"]
    summary = run(load_config(None, [*base, f"placement.strategy={NAME}", "run.name=toy"]))
    toy = tmp_path / "toy"
    assert summary["strategy"] == NAME
    # its two processes ran under the coordinator, each with its own log
    assert (toy / "logs" / "learner.log").exists() and (toy / "logs" / "sampler.log").exists()
    assert (toy / "placement.txt").read_text().startswith(f"strategy {NAME} on 1")
    records = read_metrics(toy / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    # on-policy: each step sampled the weights the step before trained
    assert [r["rollout_version"] for r in records] == [0, 1, 2]
    # the policy it saved is the trained one
    policy = load_file(str(toy / "policy" / "model.safetensors"))
    assert summary["final_reward"] != summary["sft_reward"]
    # the same trajectory as Flattening's, which runs every phase in one process
    run(load_config(None, [*base, "run.name=flat"]))
    flat = read_metrics(tmp_path / "flat" / "metrics.jsonl")
    for a, b in zip(flat, records, strict=True):
        for k in ("policy_loss", "reward", "kl", "entropy", "response_length"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-5), (a["step"], k)
    flat_policy = load_file(str(tmp_path / "flat" / "policy" / "model.safetensors"))
    assert all(torch.allclose(policy[k], flat_policy[k], atol=1e-5) for k in policy)


def test_nothing_outside_this_file_names_the_toy():
    """Neither its name as a string nor this module (its programs, its `STRATEGY`)."""
    here = Path(__file__).resolve()
    names = (f'"{NAME}"', f"'{NAME}'", here.stem)
    named = [str(p.relative_to(REPO)) for top in ("rlhf_async", "nodes", "tests")
             for p in (REPO / top).rglob("*.py")
             if p != here and any(n in p.read_text() for n in names)]
    assert named == []


def test_a_teacher_of_its_own_names_the_strategies_with_scorer_processes(monkeypatch):
    monkeypatch.setitem(registry.STRATEGIES, NAME, STRATEGY)
    # Separation under another name: a second strategy whose scorers hold the teacher
    monkeypatch.setitem(registry.STRATEGIES, "scored", dataclasses.replace(
        registry.STRATEGIES["separation"], name="scored"))
    _, problems = registry.build_placement(
        PlacementConfig(strategy=NAME, devices=2, teacher=[1]), "grpo")
    assert problems == [
        f"placement.teacher: {NAME} has no scorer processes, which hold the teacher on "
        "devices of their own (placement.teacher); use placement.strategy = separation or "
        "scored, or leave placement.teacher empty"]


def test_a_strategys_own_failure_is_one_line_on_the_command_line(tmp_path, cache, monkeypatch,
                                                                   capsys):
    def broken(*_: object) -> RunResult:
        raise TandemFailed("sampler: died 3 times in a row")

    monkeypatch.setitem(registry.STRATEGIES, NAME, dataclasses.replace(STRATEGY, run=broken))
    code = main(["run", *TINY, f"run.cache_dir={json.dumps(str(cache))}",
                 f"run.output_dir={json.dumps(str(tmp_path))}", f"placement.strategy={NAME}"])
    err = capsys.readouterr().err
    assert code == 1 and "rlhf-async run: error: sampler: died 3 times in a row" in err, err
    assert "Traceback" not in err
