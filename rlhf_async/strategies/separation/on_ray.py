"""Separation on a Ray cluster (`placement.launcher = ray`): one placement group for the job,
one bundle per device; every node runs on its device's bundle (`RayLauncher`); the node
specs are the single-host ones re-addressed to CURVE tcp between the Ray nodes' addresses
(`tcp_specs`), on ports free on each host. Coordinator, heartbeats,
restarts, exactly-once and the weight broadcast are ours, as on one machine (`drive`).
A node restarted where Ray moved its bundle (its Ray node died) binds on its new host, and
the coordinator points its peers there (`Coordinator.readdress`).

Nodes read the SFT/RM artefacts, the CURVE keys (RUN_DIR/keys) and write logs and
checkpoints under the coordinator's paths, so `run.cache_dir` and `run.output_dir` must be
on a filesystem every Ray node sees (on one machine they are).
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

from rlhf_async.config import JobConfig, weight_sync_backend
from rlhf_async.control.coordinator import Coordinator
from rlhf_async.runtime import run_loop
from rlhf_async.runtime.ray_cluster import (
    DeviceGroup,
    ray,
    ray_cluster,
    reserve,
)
from rlhf_async.runtime.ray_launcher import RayLauncher, device_index
from rlhf_async.strategies.base import RunResult
from rlhf_async.strategies.placement import Placement
from rlhf_async.strategies.separation.runner import build_specs, chunks_per_step, drive
from rlhf_async.strategies.separation.tcp import tcp_specs
from rlhf_async.task.artefacts import Artefacts
from rlhf_async.weight_sync import GroupSpec
from rlhf_async.wire.transport import Endpoint, Transport


def run(cfg: JobConfig, placement: Placement, art: Artefacts, run_dir: Path,
        start_step: int = 0) -> RunResult:
    """The Separation pipeline from `start_step` with its nodes on the Ray cluster."""
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with ray_cluster(cfg) as bundles, \
            reserve(bundles, cfg.ray.placement_strategy, cfg.ray.placement_timeout_s,
                    name=f"rlhf-async:{run_dir.name}") as group:
        result = run_loop(_run(cfg, art, run_dir, placement, group, start_step))
    return RunResult(run_dir / "metrics.jsonl", Path(result["policy_dir"]),
                     time.perf_counter() - t0)


async def _run(cfg: JobConfig, art: Artefacts, run_dir: Path, placement: Placement,
               group: DeviceGroup, start_step: int) -> dict:
    specs, prompts = build_specs(cfg, art, run_dir, placement, "/unused")
    here = ray.util.get_node_ip_address()  # the coordinator, as the Ray nodes reach it
    where = {s.node_id: (group.address(device_index(s.device)), s.device) for s in specs}
    binds = Counter(where[s.node_id][0] for s in specs for ep in s.endpoints.values()
                    if ep.bind)
    binds[here] += 2  # the coordinator's control and prompts sockets
    next_port = group.port_source(binds)
    control = f"tcp://{here}:{next_port(here)}"
    specs, prompts = tcp_specs(specs, prompts, where, here, next_port)
    roles = {p.node_id: p.role for p in placement.processes}
    gens = [n for n, r in roles.items() if r == "generator"]
    sync = GroupSpec(weight_sync_backend(cfg), where["trainer"][0], 0, 1 + len(gens),
                     timeout_s=cfg.weight_sync.timeout_s)
    launcher = RayLauncher(group, specs)
    # a tcp control endpoint: the coordinator makes CURVE keys in RUN_DIR/keys, which every
    # node and the prompts socket then use
    async with Coordinator(run_dir, launcher=launcher, control=control,
                           time_to_dead=cfg.runtime.time_to_dead,
                           restart_limit=cfg.runtime.restart_limit,
                           ready_timeout=cfg.runtime.ready_timeout_s,
                           stable_after_s=cfg.runtime.stable_after_s,
                           stop_timeout=cfg.runtime.stop_grace_s + 5.0) as coord, \
            Transport(keys=coord.keyring) as transport:
        coord.install_signal_handlers()
        launcher.on_move = coord.readdress  # a node restarted on another host
        push = transport.channel(Endpoint("push", prompts, bind=True, hwm=64))
        return await drive(cfg, coord, push, specs, roles, sync, gens, run_dir, start_step,
                           chunks_per_step(cfg, placement))
