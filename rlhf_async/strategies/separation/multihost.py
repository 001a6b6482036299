"""Separation across hosts: the single-host node specs, re-addressed to CURVE tcp, and
launched through each host's agent (`run_hosts`). The job around it (artefacts, resume,
summary) is `rlhf_async.job.multihost`; the command is `python -m rlhf_async.cli.multihost`.

Global device i is the i-th device of the hosts file. Nodes read the SFT/RM artefacts and
write checkpoints under the same paths as the coordinator, so `run.cache_dir` and
`run.output_dir` must be on a shared filesystem (NFS, Lustre), as on most bare-metal clusters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from rlhf_async.config import JobConfig, weight_sync_backend
from rlhf_async.control.coordinator import Coordinator
from rlhf_async.log import get_logger
from rlhf_async.runtime import NodeSpec
from rlhf_async.runtime.hosts import Host, device_map
from rlhf_async.runtime.remote import RemoteLauncher
from rlhf_async.strategies.placement import Placement
from rlhf_async.strategies.separation.runner import build_specs, drive
from rlhf_async.strategies.separation.startup import PipelineError
from rlhf_async.task.pretrain import Artefacts
from rlhf_async.weight_sync import GroupSpec
from rlhf_async.wire.security import Keyring
from rlhf_async.wire.transport import Endpoint, Transport

log = get_logger(component="multihost")
BASE_PORT = 7300  # data endpoints get consecutive ports from here on their host


def node_hosts(placement: Placement, hosts: list[Host]) -> dict[str, tuple[Host, str]]:
    """node id -> (its host, its device there), from the node's first global device."""
    devices = device_map(hosts)
    out = {}
    for p in placement.processes:
        if p.devices[0] >= len(devices):
            raise PipelineError(f"node {p.node_id} wants device {p.devices[0]}; the hosts "
                                f"file lends only {len(devices)} devices")
        out[p.node_id] = devices[p.devices[0]]
    return out


def tcp_specs(specs: list[NodeSpec], prompts: str, where: dict[str, tuple[str, str]],
              coordinator: str, next_port: Callable[[str], int] | None = None
              ) -> tuple[list[NodeSpec], str]:
    """Give every bound ipc endpoint a tcp address on its node's host (`where`: node id ->
    (host address, device there); the prompts queue on the coordinator's), point every
    connect at it, and set each node's device. Ports come from `next_port(host address)`,
    by default consecutive from BASE_PORT on each host."""
    ports: dict[str, int] = {}
    moved: dict[str, str] = {}

    def consecutive(host_address: str) -> int:
        ports[host_address] = ports.get(host_address, BASE_PORT - 1) + 1
        return ports[host_address]

    def tcp(address: str, host_address: str) -> str:
        moved[address] = f"tcp://{host_address}:{(next_port or consecutive)(host_address)}"
        return moved[address]

    new_prompts = tcp(prompts, coordinator)
    for spec in specs:
        for ep in spec.endpoints.values():
            if ep.bind:
                tcp(ep.address, where[spec.node_id][0])
    out = []
    for spec in specs:
        eps = {name: replace(ep, address=moved.get(ep.address, ep.address),
                             also=tuple(moved.get(a, a) for a in ep.also))
               for name, ep in spec.endpoints.items()}
        out.append(replace(spec, endpoints=eps, device=where[spec.node_id][1]))
    return out, new_prompts


async def run_hosts(cfg: JobConfig, art: Artefacts, run_dir: Path, placement: Placement,
                    hosts: list[Host], keys: Path, address: str, start_step: int) -> dict:
    where = node_hosts(placement, hosts)
    specs, prompts = build_specs(cfg, art, run_dir, placement, "/unused")
    specs, prompts = tcp_specs(specs, prompts, {n: (h.address, d) for n, (h, d) in where.items()},
                               address)
    roles = {p.node_id: p.role for p in placement.processes}
    gens = [n for n, r in roles.items() if r == "generator"]
    trainer_host = where["trainer"][0].address if "trainer" in where else address
    spec = GroupSpec(weight_sync_backend(cfg), trainer_host, 0, 1 + len(gens),
                     timeout_s=cfg.weight_sync.timeout_s)
    launcher = RemoteLauncher(hosts, run=run_dir.name, keys=keys,
                              placement={n: h.name for n, (h, _) in where.items()})
    try:
        async with Transport(keys=Keyring.load(keys)) as transport, \
                Coordinator(run_dir, launcher=launcher, control=f"tcp://{address}:{BASE_PORT - 1}",
                            keys=keys, time_to_dead=cfg.runtime.time_to_dead,
                            restart_limit=cfg.runtime.restart_limit,
                            stop_timeout=cfg.runtime.stop_grace_s + 5.0) as coord:
            coord.install_signal_handlers()
            push = transport.channel(Endpoint("push", prompts, bind=True, hwm=64))
            return await drive(cfg, coord, push, specs, roles, spec, gens, run_dir, start_step)
    finally:
        launcher.close()
