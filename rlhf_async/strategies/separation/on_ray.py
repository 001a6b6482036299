"""Separation on a Ray cluster (`placement.launcher = ray`): one placement group for the job,
one bundle per device; every node runs on its device's bundle (`RayLauncher`); the node
specs are the single-host ones re-addressed to CURVE tcp between the Ray nodes' addresses
(`tcp_specs`), on ports free on each host. Coordinator, heartbeats,
restarts, exactly-once and the weight broadcast are ours, as on one machine (`drive`).
A node restarted where Ray moved its bundle (its Ray node died) binds on its new host, and
the coordinator points its peers there (`Coordinator.readdress`).

`rlhf-async scale` works as on one machine (scaling.py); a new process takes a free bundle
of the job's group, else a new bundle (`RayDevices`: a one-bundle placement group per
device, of the job's bundle shape), which a cluster too small for it refuses at once
(ReshapeError naming what is missing; the job goes on at its old shape). A scale down
gives such bundles back once no process uses them.

Nodes read the SFT/RM artefacts, the CURVE keys (RUN_DIR/keys) and write logs and
checkpoints under the coordinator's paths, so `run.cache_dir` and `run.output_dir` must be
on a filesystem every Ray node sees (on one machine they are).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

from rlhf_async.config import JobConfig, weight_sync_backend
from rlhf_async.control.reshape import ReshapeError
from rlhf_async.runtime import NodeSpec, run_loop
from rlhf_async.runtime.ray_cluster import (
    DeviceGroup,
    RayPlacementError,
    ray,
    ray_cluster,
    reserve,
)
from rlhf_async.runtime.ray_launcher import RayLauncher, device_index
from rlhf_async.strategies.base import RunResult, job_coordinator
from rlhf_async.strategies.placement import Placement
from rlhf_async.strategies.separation.runner import build_specs, chunks_per_step, drive
from rlhf_async.strategies.separation.scaling import Scaler
from rlhf_async.strategies.separation.tcp import tcp_specs
from rlhf_async.strategies.utilization import job_utilization
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


def on_hosts(group: DeviceGroup, specs: list[NodeSpec], prompts: str, here: str,
             known: dict[str, str], more: int = 0) -> tuple[list[NodeSpec], str, list[str]]:
    """`specs` and the prompts address re-addressed to tcp on their devices' hosts (the
    addresses in `known` kept), and `more` tcp addresses free on `here` (the coordinator's
    host) for the caller. Asks other hosts for free ports: blocking Ray calls."""
    where = {s.node_id: (group.address(device_index(s.device)), s.device) for s in specs}
    binds = Counter(where[s.node_id][0] for s in specs for ep in s.endpoints.values()
                    if ep.bind and ep.address not in known)
    binds[here] += more + (prompts not in known)  # the coordinator's control, prompts
    next_port = group.port_source(binds)
    mine = [f"tcp://{here}:{next_port(here)}" for _ in range(more)]
    specs, prompts = tcp_specs(specs, prompts, where, here, next_port, known)
    return specs, prompts, mine


class RayDevices:
    """A Ray job's devices for a scale (scaling.Devices): a device past the job's
    placement group gets a bundle of its own (`DeviceGroup.grow`), given back when no
    process uses it; GPU shares of each bundle follow the processes on it."""

    def __init__(self, group: DeviceGroup, launcher: RayLauncher, timeout_s: float) -> None:
        self.group, self.launcher, self.timeout_s = group, launcher, timeout_s

    async def reserve(self, old: Placement, new: Placement) -> None:
        need = sorted({d for q in new.processes for d in q.devices if not self.group.holds(d)})
        if need:
            try:
                await asyncio.to_thread(self.group.grow, need, self.timeout_s)
            except RayPlacementError as e:
                shape = ", ".join(f"{len(old.by_role(r))} {r}(s)" for r in ("generator", "scorer"))
                raise ReshapeError(f"{e}; the job goes on with {shape}") from None
        # a process retired later shares its device with its successor until it stops
        first = {q.node_id: q.devices[0] for q in (*old.processes, *new.processes)}
        self.launcher.share_devices(list(first.values()))

    async def settle(self, p: Placement) -> None:
        used = {d for q in p.processes for d in q.devices}
        unused = [d for d in self.group.extra if d not in used]
        if unused:
            await asyncio.to_thread(self.group.release, unused)
        self.launcher.share_devices([q.devices[0] for q in p.processes])


async def _run(cfg: JobConfig, art: Artefacts, run_dir: Path, placement: Placement,
               group: DeviceGroup, start_step: int) -> dict:
    ipc_specs, ipc_prompts = build_specs(cfg, art, run_dir, placement, "/unused")
    here = ray.util.get_node_ip_address()  # the coordinator, as the Ray nodes reach it
    specs, prompts, (control,) = on_hosts(group, ipc_specs, ipc_prompts, here, {}, more=1)
    roles = {p.node_id: p.role for p in placement.processes}
    gens = [n for n, r in roles.items() if r == "generator"]
    trainer = next(s for s in specs if s.node_id == "trainer").host() or here
    sync = GroupSpec(weight_sync_backend(cfg), trainer, 0, 1 + len(gens),
                     timeout_s=cfg.weight_sync.timeout_s)
    launcher = RayLauncher(group, specs)
    # a tcp control endpoint: the coordinator makes CURVE keys in RUN_DIR/keys, which every
    # node and the prompts socket then use
    async with job_coordinator(cfg, run_dir, launcher, control=control) as coord, \
            Transport(keys=coord.keyring) as transport:
        coord.install_signal_handlers()
        launcher.on_move = coord.readdress  # a node restarted on another host

        async def specs_for(p: Placement) -> list[NodeSpec]:
            """A scaled job's specs: running nodes keep the addresses they bind now."""
            ipc, _ = build_specs(cfg, art, run_dir, p, "/unused")
            known = {ipc_prompts: prompts}
            for s in ipc:
                if (record := coord.nodes.get(s.node_id)) is not None:
                    known.update({ep.address: record.spec.endpoints[name].address
                                  for name, ep in s.endpoints.items() if ep.bind})
            return (await asyncio.to_thread(on_hosts, group, ipc, ipc_prompts, here, known))[0]

        push = transport.channel(Endpoint("push", prompts, bind=True, hwm=64))
        devices = RayDevices(group, launcher, cfg.ray.placement_timeout_s)
        return await drive(cfg, coord, push, specs, roles, sync, gens, run_dir, start_step,
                           chunks_per_step(cfg, placement), 1,
                           lambda driver: Scaler(cfg, coord, driver, placement, specs_for,
                                                 lambda p: chunks_per_step(cfg, p), run_dir,
                                                 devices),
                           job_utilization(cfg, art, placement.num_devices))
