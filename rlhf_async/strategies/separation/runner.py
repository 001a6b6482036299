"""Separation as a job: node specs from a `Placement`, then coordinator + driver.

    trainer (actor, critic)  <-- scored --  scorers (reward, reference)
        |  weight broadcast                      ^ rollouts
        v                                        |
    generators (shadow actor)  --------------------
        ^ prompts (from the coordinator, under the staleness gate)
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlhf_async.config import JobConfig, to_dict, weight_sync_backend
from rlhf_async.control.coordinator import Coordinator
from rlhf_async.control.reshape import Scale
from rlhf_async.engines import ENGINES, engine_lines, generation_engine
from rlhf_async.engines.sim.metrics import SimulatedTime
from rlhf_async.log import get_logger
from rlhf_async.modeling.flops import Utilization
from rlhf_async.runtime import NodeSpec, run_loop
from rlhf_async.runtime.ipc_dir import make_ipc_dir
from rlhf_async.runtime.launcher import LocalLauncher
from rlhf_async.strategies.base import JobStopped, RunResult, job_coordinator
from rlhf_async.strategies.placement import Placement, ProcessPlacement
from rlhf_async.strategies.separation.clients import (
    GeneratorClient,
    PipelineError,
    TrainerClient,
    connect_weight_sync,
)
from rlhf_async.strategies.separation.driver import Driver
from rlhf_async.strategies.separation.rebalance import Rebalancer
from rlhf_async.strategies.separation.scaling import Scaler
from rlhf_async.strategies.separation.startup import generator_ranks, wait_loaded
from rlhf_async.strategies.separation.trainer_ranks import TrainerRanks
from rlhf_async.strategies.step_health import NothingTrained
from rlhf_async.strategies.utilization import job_utilization
from rlhf_async.task.adapters import adapter_lines
from rlhf_async.task.artefacts import Artefacts
from rlhf_async.weight_sync import GroupSpec
from rlhf_async.wire.transport import Endpoint, Transport

# the node programs (the top-level `nodes/` package, which the library never imports): what
# each role runs, and what the fork server imports before it forks them
ENTRIES = {"trainer": "nodes.trainer.main:main", "generator": "nodes.generator.main:main",
           "scorer": "nodes.scorer.main:main"}
NODE_MODULES = tuple(entry.partition(":")[0] for entry in ENTRIES.values())
log = get_logger(component="pipeline")


def _device(cfg: JobConfig, proc: ProcessPlacement) -> str:
    return f"cuda:{proc.devices[0]}" if cfg.placement.device == "cuda" else f"cpu:{proc.devices[0]}"


def _tensor_parallel(cfg: JobConfig, proc: ProcessPlacement) -> tuple[str, dict[str, str]]:
    """A tensor-parallel generator's device and env: on GPUs it sees only its own devices
    (as cuda:0..tp-1, numbered within what this process was given), and the engine starts
    one worker on each; on CPUs each worker's threads are bound to its slot's core through
    the engine's `cpu_bind_env` (an engine's CPU build may ask for it where it cannot bind
    one NUMA node per worker; a binding the user set is kept)."""
    if cfg.placement.device != "cuda":
        bind = ENGINES[generation_engine(cfg)].cpu_bind_env
        if bind is None or bind in os.environ:
            return _device(cfg, proc), {}
        cores = os.cpu_count() or 1
        return _device(cfg, proc), {bind: "|".join(str(d % cores) for d in proc.devices)}
    given = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = given.split(",") if given else [str(d) for d in range(max(proc.devices) + 1)]
    return "cuda:0", {"CUDA_VISIBLE_DEVICES": ",".join(ids[d] for d in proc.devices)}


def build_specs(cfg: JobConfig, art: Artefacts, run_dir: Path, placement: Placement,
                sock_dir: str) -> tuple[list[NodeSpec], str]:
    """Node specs for every process of the placement, and the prompts address the
    coordinator binds."""
    hwm = 64  # chunks; the staleness gate bounds what is in flight well below this
    prompts = f"ipc://{sock_dir}/prompts"
    scored = f"ipc://{sock_dir}/scored"
    scorers = [f"ipc://{sock_dir}/{p.node_id}" for p in placement.by_role("scorer")]
    params: dict[str, Any] = {
        "config": to_dict(cfg), "sft_dir": str(art.sft_dir),
        "rm_dir": "" if art.rm_dir is None else str(art.rm_dir),
        "policy_dir": str(run_dir / "policy"), "precision": placement.precision().to_dict(),
        "checkpoint_dir": str(run_dir / "checkpoints"), "engines": engine_lines(cfg),
        "adapters": adapter_lines(cfg.task)}
    endpoints = {
        "trainer": {"scored": Endpoint("pull", scored, bind=True, hwm=hwm)},
        "generator": {"prompts": Endpoint("pull", prompts, hwm=hwm)},
    }
    gens = [p.node_id for p in placement.by_role("generator")]
    trainers = [p.node_id for p in placement.by_role("trainer")]
    tp = generator_ranks(placement)
    specs = []
    for proc in placement.processes:
        eps = endpoints.get(proc.role) or {
            "rollouts": Endpoint("pull", f"ipc://{sock_dir}/{proc.node_id}", bind=True, hwm=hwm),
            "scored": Endpoint("push", scored, hwm=hwm)}
        mine = params
        if proc.role == "generator":
            eps = {**eps, "rollouts": _rollouts(scorers, gens.index(proc.node_id), hwm)}
        if proc.role == "trainer":  # rank 0 takes the scored chunks; the others follow it
            rank = trainers.index(proc.node_id)
            mine = {**params, "rank": rank, "world": len(trainers)}
            eps = eps if rank == 0 else {}
        device, env = _device(cfg, proc), dict[str, str]()
        if proc.role == "generator" and tp > 1:
            mine = {**params, "tensor_parallel": tp}
            device, env = _tensor_parallel(cfg, proc)
        specs.append(NodeSpec(proc.role, proc.node_id, ENTRIES[proc.role], eps, mine,
                              device=device, num_threads=cfg.placement.cpu_threads,
                              flush_denormal=cfg.placement.flush_denormal,
                              orphan_timeout_s=30.0,
                              # the trainer finishes its step and writes its checkpoint
                              stop_grace_s=cfg.runtime.stop_grace_s
                              if proc.role == "trainer" else 1.0,
                              # one malloc arena per worker thread grew the trainer's RSS by
                              # ~10% in a 10-minute soak; two arenas kept it flat
                              env={"MALLOC_ARENA_MAX": "2", **env}))
    return specs, prompts


def _rollouts(scorers: list[str], i: int, hwm: int) -> Endpoint:
    """Generator i's rollouts endpoint: every scorer, from scorer i mod n on. A PUSH socket
    deals its messages over its peers in the order it connected to them, and a generator
    sends one chunk a step: with one order for all, every generator sent a step's chunk to
    the same scorer, which scored the whole step while the others waited (the twin showed
    two of four scorers busy in each step, the step's scoring n times as long)."""
    k = i % len(scorers)
    order = scorers[k:] + scorers[:k]
    return Endpoint("push", order[0], hwm=hwm, also=tuple(order[1:]))


def sync_backend(cfg: JobConfig, placement: Placement) -> JobConfig:
    """`weight_sync.backend = auto` on GPUs where two ranks of the weight-sync group share a
    GPU (the trainer and a generator on one device; NCCL refuses that): gloo, staged through
    host memory. Nodes read the backend from the config this returns."""
    if cfg.weight_sync.backend != "auto" or cfg.placement.device != "cuda":
        return cfg
    ranks = [set(p.devices) for p in [*placement.by_role("trainer")[:1],
                                      *placement.by_role("generator")]]
    if not any(a & b for i, a in enumerate(ranks) for b in ranks[i + 1:]):
        return cfg
    log.info("weight_sync_backend", backend="gloo",
             why="the trainer and a generator share a GPU, which NCCL refuses")
    return dataclasses.replace(cfg, weight_sync=dataclasses.replace(cfg.weight_sync,
                                                                   backend="gloo"))


def chunks_per_step(cfg: JobConfig, placement: Placement) -> int:
    """Chunks a step's prompts are cut into: one per generator, or two per generator where
    that is the only overlap there is: synchronous steps (max_staleness 0) with scorers on
    devices of their own, which score one chunk while the next is generated. With
    staleness, generation of the next step already overlaps scoring and training of this
    one; on a shared device the two would only take turns; and a decode step over twice
    the rows costs little more (it streams the same weights). At 6x384, 48 tokens, 2 cores:
    43.6-49.4 against 36.2-40.5 completions/s; 4x128 with the scorer on the trainer's core:
    244 against 203 (bench/README.md)."""
    gens = [p for p in placement.processes if p.role == "generator"]
    scorers = [p for p in placement.processes if p.role == "scorer"]
    shared = any(set(s.devices) & set(g.devices) for s in scorers for g in gens)
    per_generator = 1 if shared or cfg.algo.max_staleness > 0 else 2
    return max(1, min(per_generator * len(gens), cfg.train.prompts_per_step))


async def _run(cfg: JobConfig, art: Artefacts, run_dir: Path, placement: Placement,
               sock_dir: str, start_step: int) -> dict:
    specs, prompts_addr = build_specs(cfg, art, run_dir, placement, sock_dir)
    roles = {p.node_id: p.role for p in placement.processes}
    gens = [n for n, r in roles.items() if r == "generator"]
    spec = GroupSpec(weight_sync_backend(cfg), "127.0.0.1", 0, 1 + len(gens),
                     timeout_s=cfg.weight_sync.timeout_s)
    async with Transport() as transport, \
            job_coordinator(cfg, run_dir, LocalLauncher(start=cfg.runtime.node_start,
                                                        preload=NODE_MODULES)) as coord:
        coord.install_signal_handlers()
        prompts = transport.channel(Endpoint("push", prompts_addr, bind=True, hwm=64))

        async def specs_for(p: Placement) -> list[NodeSpec]:  # a scaled job's
            return build_specs(cfg, art, run_dir, p, sock_dir)[0]

        return await drive(cfg, coord, prompts, specs, roles, spec, gens, run_dir, start_step,
                           chunks_per_step(cfg, placement), generator_ranks(placement),
                           lambda driver: Scaler(cfg, coord, driver, placement, specs_for,
                                                 lambda p: chunks_per_step(cfg, p), run_dir),
                           job_utilization(cfg, art, placement.num_devices))


async def drive(cfg: JobConfig, coord: Coordinator, prompts: Any, specs: list[NodeSpec],
                roles: Any, spec: GroupSpec, gens: list[str], run_dir: Path,
                start_step: int, chunks: int, gen_ranks: int = 1,
                scaler: Callable[[Driver], Scaler] | None = None,
                utilization: Utilization | None = None) -> Any:
    """Launch the nodes, check the trainer restored `start_step`, join the weight-sync
    group (`gen_ranks` ranks per generator) and run the Driver to the end, each step's
    prompts cut into `chunks` (local and multi-host runs alike); with `scaler`, the
    coordinator answers `scale` commands (scaling.py) once the Driver runs."""
    with coord.events() as events:
        await coord.launch(specs)
        ranks = TrainerRanks(coord, [n for n, r in roles.items() if r == "trainer"],
                             spec.master_addr, cfg.runtime.ready_timeout_s)
        ranks.form()  # several trainer ranks load their models once their group stands
        loaded, backlog = await wait_loaded(events, list(roles), coord.ready_timeout, ranks)
        if loaded["trainer"].step != start_step:
            raise PipelineError(f"the trainer restored step {loaded['trainer'].step}, "
                                f"expected {start_step}")
        spec = await connect_weight_sync(TrainerClient(coord),
                                         [GeneratorClient(coord, g) for g in gens], spec,
                                         gen_ranks)
        driver = Driver(cfg, coord, events, prompts, roles, spec, run_dir, chunks,
                        start_step, loaded["trainer"].lineage, ranks, backlog, gen_ranks,
                        utilization)
        if cfg.placement.device == "sim":  # first: the rebalancer reads simulated seconds
            driver.records.on_record.append(SimulatedTime(cfg.sim.time_scale))
        if scaler is not None:
            scaling = scaler(driver)
            coord.handle(Scale, scaling.scale)
            if cfg.placement.rebalance:
                driver.records.on_record.append(Rebalancer(
                    scaling, cfg.placement.rebalance_every, cfg.placement.rebalance_gain,
                    cfg.algo.max_staleness, driver.spawn).observe)
        try:
            result = await coord.run_until_stop(driver.run())
        except NothingTrained:  # stopped like a stop request, then the error
            await driver.finish_stopping(cfg.runtime.stop_grace_s)
            raise driver.records.health.stop() from None
        if result is None:  # stopped: the trainer finishes its step and checkpoints
            await driver.finish_stopping(cfg.runtime.stop_grace_s)
            raise JobStopped(coord.stop_reason)
    return result


def run(cfg: JobConfig, placement: Placement, art: Artefacts, run_dir: Path,
        start_step: int = 0) -> RunResult:
    """Run the RL phase as the Separation pipeline from `start_step` (the trainer restores
    the checkpoint of that step); returns where metrics and policy are."""
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    sock_dir = make_ipc_dir()  # named by our pid: a killed run's is swept later
    cfg = sync_backend(cfg, placement)
    t0 = time.perf_counter()
    try:
        result = run_loop(_run(cfg, art, run_dir, placement, sock_dir, start_step))
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
    return RunResult(run_dir / "metrics.jsonl", Path(result["policy_dir"]),
                     time.perf_counter() - t0)
