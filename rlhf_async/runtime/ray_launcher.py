"""RayLauncher: a `Launcher` whose nodes run on the Ray nodes holding their devices' bundles.

    with ray_session("auto"), reserve(bundles, "PACK", 60.0) as group:   # ray_cluster.py
        Coordinator(run_dir, launcher=RayLauncher(group, specs), control="tcp://...")

Ray places and supervises; the node is the same command as on one machine (`start_node`),
started by a small actor (`NodeHost`) on the bundle of the node's device (`cpu:3` / `cuda:3`:
bundle 3). The actor asks for no CPU (the bundle holds them for the job) and, on a GPU
bundle, for its share of that GPU, so Ray hands it the GPU (CUDA_VISIBLE_DEVICES, which the
node inherits) and the node uses it as cuda:0. Where each process ran is one line of
RUN_DIR/ray_nodes.jsonl.

A node started on a bundle that Ray moved to another host (its Ray node died) cannot bind
where its spec says: the actor gives each bound tcp endpoint a port free on its own host
(`rehome`), records the move (`moved`: old address -> new) and hands it to `on_move`, which
the coordinator uses to point the node's peers at the new addresses.

`poll` never blocks: it reads answers already in and asks the actor again every
POLL_EVERY_S. An actor that died, or whose Ray node died, is a process that exited with
LOST; the node process itself dies with its actor (PR_SET_PDEATHSIG). `kill` SIGKILLs the
process and then ends its actor, freeing its share of the bundle for a replacement.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from rlhf_async.log import get_logger
from rlhf_async.runtime.launcher import start_node, start_process, wait_polling
from rlhf_async.runtime.ray_cluster import DeviceGroup, free_ports, ray
from rlhf_async.runtime.spec import NodeSpec, tcp_host

if ray is not None:
    from ray.exceptions import ActorUnavailableError, RayError
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

log = get_logger(component="ray")
LOST = 255  # exit code of a node whose actor or Ray node died
POLL_EVERY_S = 0.2


def device_index(device: str) -> int:
    """`cuda:3` / `cpu:3` -> 3: the global device, which is its bundle."""
    _, _, index = device.partition(":")
    return int(index) if index.isdigit() else 0


def rehome(spec: NodeSpec, host: str) -> dict[str, str]:
    """old -> new for each tcp address `spec` binds on a host other than `host`: the same
    endpoint on a port free on `host` (where this runs)."""
    away = [a for a in spec.bound_tcp() if tcp_host(a) != host]
    return {old: f"tcp://{host}:{port}" for old, port in zip(away, free_ports(len(away)),
                                                              strict=True)}


class NodeHost:
    """The Ray actor around one node process, on the node's host. Its methods are quick
    (the actor runs them one at a time), so `signal` is never stuck behind another."""

    def __init__(self, spec: dict[str, Any], run_dir: str,
                 command: list[str] | None = None) -> None:
        # on the actor's main thread, which lives as long as the actor: the process's
        # parent-death signal fires when the actor dies, not before
        node = NodeSpec.from_dict(spec)
        address = ray.util.get_node_ip_address()
        moved = rehome(node, address)
        node = node.readdressed(moved)
        self.popen, log_path = start_node(node, Path(run_dir)) if command is None else \
            start_process([sys.executable, *command], node, Path(run_dir))
        self.where = {"pid": self.popen.pid, "ray_node": ray.get_runtime_context().get_node_id(),
                      "address": address, "host": socket.gethostname(),
                      "gpus": [str(g) for g in ray.get_gpu_ids()], "log": str(log_path),
                      **({"moved": moved} if moved else {})}

    def info(self) -> dict[str, Any]:
        return self.where

    def poll(self) -> int | None:
        return self.popen.poll()

    def signal(self, signum: int) -> int | None:
        """Send `signum` to the process if it runs; after SIGKILL, its exit code."""
        if self.popen.poll() is None:
            self.popen.send_signal(signum)
        if signum == signal.SIGKILL:
            try:
                return self.popen.wait(10)
            except subprocess.TimeoutExpired:  # stuck in the kernel: the actor ends anyway
                return None
        return self.popen.poll()


class RayProcess:
    """A node run by a NodeHost actor, shaped like Popen."""

    def __init__(self, actor: Any, node: str, bundle: int, record: Path,
                 on_move: Callable[[str, dict[str, str]], None] | None = None) -> None:
        self.actor, self.node, self.bundle, self.record = actor, node, bundle, record
        self.on_move = on_move
        self.pid: int | None = None  # known once the actor has started the process
        self.log_path = f"logs/{node}.log of the run directory (on its Ray node)"
        self._info = actor.info.remote()
        self._pending: Any = None
        self._asked = 0.0
        self._rc: int | None = None
        self._ended = False

    @staticmethod
    def _ready(ref: Any) -> bool:
        return bool(ray.wait([ref], timeout=0)[0])

    def _answer(self, ref: Any) -> Any:
        """The answer of a finished call; raises RayError for a dead actor or node."""
        try:
            return ray.get(ref)
        except ActorUnavailableError:  # unreachable for now: asked again later
            return None

    def _lost(self, error: Exception) -> int:
        log.error("ray node process lost", node=self.node, bundle=self.bundle,
                  error=str(error).splitlines()[0])
        self._rc, self._ended = LOST, True
        return LOST

    def poll(self) -> int | None:
        if self._rc is not None:
            return self._rc
        try:
            if self.pid is None and self._ready(self._info):
                self._started(ray.get(self._info))
            if self._pending is not None and self._ready(self._pending):
                self._rc, self._pending = self._answer(self._pending), None
        except RayError as e:
            return self._lost(e)
        now = time.monotonic()
        if self._rc is None and self._pending is None and now - self._asked > POLL_EVERY_S:
            self._asked, self._pending = now, self.actor.poll.remote()
        if self._rc is not None:
            self._end()  # the process is gone: free its share of the bundle
        return self._rc

    def _started(self, info: dict[str, Any]) -> None:
        self.pid = int(info["pid"])
        self.log_path = f"{info['log']} on {info['host']}"
        log.info("ray node process started", node=self.node, bundle=self.bundle, **info)
        with open(self.record, "a") as f:
            f.write(json.dumps({"node": self.node, "bundle": self.bundle, **info}) + "\n")
        if info.get("moved"):
            log.warning("ray node process moved", node=self.node, bundle=self.bundle,
                        address=info["address"], moved=info["moved"])
            if self.on_move is not None:
                self.on_move(self.node, dict(info["moved"]))

    async def wait(self, timeout: float | None = None) -> int | None:
        return await wait_polling(self.poll, timeout, 0.05)

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            self.actor.__ray_terminate__.remote()  # after the calls already sent

    def terminate(self) -> None:
        if self._rc is None:
            self.actor.signal.remote(signal.SIGTERM)

    def kill(self) -> None:
        if self._rc is None and not self._ended:
            self._pending = self.actor.signal.remote(signal.SIGKILL)
        self._end()


class RayLauncher:
    """Launches each node through a NodeHost actor on its device's bundle of `group`.
    `specs` are the job's nodes: processes sharing a GPU each get an equal share of it;
    a bundle is its device's in the job's group, or one a scale added (`DeviceGroup.bundle`).
    `on_move(node, {old: new})` hears of a node that had to bind on new addresses."""

    def __init__(self, group: DeviceGroup, specs: list[NodeSpec],
                 on_move: Callable[[str, dict[str, str]], None] | None = None) -> None:
        self.group, self.on_move = group, on_move
        self.share_devices([device_index(s.device) for s in specs])
        self.host = ray.remote(NodeHost)

    def share_devices(self, devices: list[int]) -> None:
        """Each process's device from now on (a scale changes them): a later start on a
        GPU device asks for an equal share of it."""
        self.shares = Counter(devices)

    def launch(self, spec: NodeSpec, run_dir: Path,
               command: list[str] | None = None) -> RayProcess:
        """The node `spec` on its device's bundle; with `command` (arguments of the Python
        on that host, e.g. `-m rlhf_async run ...`), that process in the node's place."""
        bundle = device_index(spec.device)
        gpu = spec.device.startswith("cuda")
        pg, index = self.group.bundle(bundle)
        on_bundle = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)
        # Ray counts in 1e-4 units; a device a scale added has no share counted yet
        share = int(10_000 / max(1, self.shares[bundle])) / 10_000
        actor = self.host.options(
            num_cpus=0, num_gpus=share if gpu else 0, max_restarts=0,
            scheduling_strategy=on_bundle,
        ).remote(replace(spec, device="cuda:0" if gpu else spec.device).to_dict(), str(run_dir),
                 command)
        return RayProcess(actor, spec.node_id, bundle, run_dir / "ray_nodes.jsonl",
                          self.on_move)
