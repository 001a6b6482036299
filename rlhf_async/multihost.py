"""Separation across hosts: the single-host node specs, re-addressed to CURVE tcp, and
launched through each host's agent.

    python -m rlhf_async.multihost --hosts HOSTS --keys KEYS --address 10.0.0.1 \\
        [CONFIG] [key=value ...]

runs the job's coordinator here (ADDRESS must be this host's address as the others reach
it) and its nodes wherever the hosts file puts their devices: global device i is the i-th
device of the hosts file. Nodes read the SFT/RM artefacts and write checkpoints under the
same paths as the coordinator, so `run.cache_dir` and `run.output_dir` must be on a shared
filesystem (NFS, Lustre), as on most bare-metal clusters.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from rlhf_async.config import JobConfig, to_dict, weight_sync_backend
from rlhf_async.coordinator import Coordinator
from rlhf_async.hosts import Host, device_map, load_hosts
from rlhf_async.log import get_logger
from rlhf_async.pipeline.driver import PipelineError
from rlhf_async.pipeline.job import build_specs, drive
from rlhf_async.placement import Placement, plan_placement
from rlhf_async.remote import RemoteLauncher
from rlhf_async.runtime import NodeSpec, run_loop
from rlhf_async.security import Keyring
from rlhf_async.task.pretrain import Artefacts
from rlhf_async.transport import Endpoint, Transport
from rlhf_async.weight_sync import GroupSpec

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


def tcp_specs(specs: list[NodeSpec], prompts: str, where: dict[str, tuple[Host, str]],
              coordinator: str, base_port: int = BASE_PORT) -> tuple[list[NodeSpec], str]:
    """Give every bound ipc endpoint a tcp address on its node's host (the prompts queue on
    the coordinator's), point every connect at it, and set each node's local device."""
    ports: dict[str, int] = {}
    moved: dict[str, str] = {}

    def tcp(address: str, host_address: str) -> str:
        ports[host_address] = ports.get(host_address, base_port - 1) + 1
        moved[address] = f"tcp://{host_address}:{ports[host_address]}"
        return moved[address]

    new_prompts = tcp(prompts, coordinator)
    for spec in specs:
        for ep in spec.endpoints.values():
            if ep.bind:
                tcp(ep.address, where[spec.node_id][0].address)
    out = []
    for spec in specs:
        eps = {name: replace(ep, address=moved.get(ep.address, ep.address),
                             also=tuple(moved.get(a, a) for a in ep.also))
               for name, ep in spec.endpoints.items()}
        out.append(replace(spec, endpoints=eps, device=where[spec.node_id][1]))
    return out, new_prompts


async def _run(cfg: JobConfig, art: Artefacts, run_dir: Path, placement: Placement, hosts: list[Host],
               keys: Path, address: str, start_step: int) -> dict:
    where = node_hosts(placement, hosts)
    specs, prompts = build_specs(cfg, art, run_dir, placement, "/unused")
    specs, prompts = tcp_specs(specs, prompts, where, address)
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
                            restart_limit=cfg.runtime.restart_limit) as coord:
            coord.install_signal_handlers()
            push = transport.channel(Endpoint("push", prompts, bind=True, hwm=64))
            return await drive(cfg, coord, push, specs, roles, spec, gens, run_dir, start_step)
    finally:
        launcher.close()


def run_multihost(cfg: JobConfig, hosts: list[Host], keys: Path, address: str) -> dict:
    """SFT/RM artefacts here, then the RL phase as Separation across the hosts."""
    from rlhf_async.checkpoint import load_latest
    from rlhf_async.job import truncate_metrics
    from rlhf_async.planner import prepare_run
    from rlhf_async.task import make_task
    from rlhf_async.task.pretrain import prepare_artefacts

    cfg = prepare_run(cfg)
    if cfg.placement.strategy != "separation":
        raise PipelineError(f"multi-host runs use placement.strategy=separation, not "
                            f"{cfg.placement.strategy!r}")
    if not cfg.run.name:
        raise PipelineError("multi-host runs need run.name (the agents' run directory name)")
    run_dir = (Path(cfg.run.output_dir) / cfg.run.name).resolve()
    ck = load_latest(run_dir / "checkpoints")
    start_step = 0 if ck is None else ck.step
    truncate_metrics(run_dir, start_step)  # steps after the checkpoint are trained again
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    art = prepare_artefacts(cfg, make_task(cfg))
    placement = plan_placement(cfg.placement, cfg.algo.name)
    (run_dir / "placement.txt").write_text(placement.table() + "\n")
    t0 = time.perf_counter()
    result = run_loop(_run(cfg, art, run_dir, placement, hosts, keys, address, start_step))
    summary = {"run_dir": str(run_dir), "start_step": start_step,
               "rl_seconds": time.perf_counter() - t0, "policy_dir": result["policy_dir"]}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> int:
    from rlhf_async.config import ConfigError, load_config
    from rlhf_async.hosts import HostsError
    from rlhf_async.log import configure_logging
    from rlhf_async.security import SecurityError

    p = argparse.ArgumentParser(prog="python -m rlhf_async.multihost",
                                description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=Path, required=True)
    p.add_argument("--keys", type=Path, required=True)
    p.add_argument("--address", required=True, help="this host's address, as others reach it")
    p.add_argument("config", nargs="?")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    configure_logging("warning")
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config:
        config, overrides = None, [config, *overrides]
    try:
        summary = run_multihost(load_config(config, overrides), load_hosts(args.hosts),
                                args.keys, args.address)
    except (ConfigError, HostsError, SecurityError, PipelineError) as e:
        print(f"multihost: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(summary))
    return 0

if __name__ == "__main__":
    sys.exit(main())
