"""A Ray cluster for one job: the connection (`ray_session`), the job's placement group with
one bundle per device (`reserve`), and where each bundle landed (`DeviceGroup`).

    with ray_session("auto"), reserve(device_bundles("cuda", 8, 1), "PACK", 60.0) as group:
        group.address(3)                       # IP of the Ray node holding device 3's bundle
        launcher = RayLauncher(group, specs)   # ray_launcher.py

Ray places and supervises processes; nothing else of a job goes through it. Whether the
cluster can hold the bundles at all is checked against its nodes before the group is made
(`missing`), and the wait for the group's resources is bounded: either way the job stops
before any node starts, with one `RayPlacementError` naming what is missing.

`ray` is the optional extra `[ray]`: without it, `ray_session` is one RayPlacementError
naming the extra. `ray_cluster` is the three together for a job's config, shared by
Separation's nodes and the lock-step strategies' ranks on Ray.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from rlhf_async.config import JobConfig
from rlhf_async.log import get_logger

try:
    import ray
    from ray.util import placement_group_table
    from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ModuleNotFoundError:  # the [ray] extra is not installed
    ray = None  # type: ignore[assignment]

log = get_logger(component="ray")
LOCAL_OBJECT_STORE = 100 * 1024**2  # ray.address = local: nothing big travels through Ray
Bundle = dict[str, float]


class RayPlacementError(RuntimeError):
    """No Ray cluster where asked, or it cannot hold the job's placement group."""


def device_bundles(kind: str, devices: int, cpus: int) -> list[Bundle]:
    """One bundle per device: a GPU (and `cpus` CPUs beside it), or a slot of `cpus` CPUs.
    Bundle i is global device i."""
    one: Bundle = {"CPU": float(cpus), **({"GPU": 1.0} if kind == "cuda" else {})}
    return [dict(one) for _ in range(devices)]


@contextlib.contextmanager
def ray_session(address: str, cpus: int = 1) -> Iterator[None]:
    """Connected to Ray in this block: to `address` (auto, HOST:PORT, ray://...), or to a
    Ray started here (`local`, with at least `cpus` logical CPUs). A process already
    connected stays so, and keeps its connection afterwards; one made here is closed."""
    if ray is None:
        raise RayPlacementError("the Ray launcher needs the 'ray' package, which is not "
                                "installed: pip install 'rlhf-async[ray]'")
    if ray.is_initialized():
        yield
        return
    quiet: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.WARNING}
    try:
        if address not in ("auto", "local"):
            _reachable(address)  # ray.init retries an unreachable address for minutes
        if address == "local":
            ray.init(num_cpus=max(cpus, os.cpu_count() or 1), include_dashboard=False,
                     object_store_memory=LOCAL_OBJECT_STORE, **quiet)
        else:
            ray.init(address=address, **quiet)
    except ConnectionError as e:
        raise RayPlacementError(
            f"ray.address = {address!r}: no Ray cluster to join ({e}); start one (`ray start "
            "--head`), name it (ray.address = HOST:PORT), or use ray.address = 'local' to "
            "start one in this process") from None
    log.info("ray connected", address=address, resources=ray.cluster_resources())
    try:
        yield
    finally:
        ray.shutdown()


def _reachable(address: str, timeout: float = 5.0) -> None:
    """ConnectionError unless HOST:PORT (or ray://HOST:PORT) accepts a tcp connection."""
    host, _, port = address.split("://")[-1].rpartition(":")
    if not port.isdigit():
        raise ConnectionError(f"{address!r} is not HOST:PORT")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        raise ConnectionError(f"{host}:{port} does not answer: {e.strerror or e}") from None


def _text(resources: Bundle) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in sorted(resources.items())) or "nothing"


def _capacity(node: Bundle, bundle: Bundle) -> int:
    """How many copies of `bundle` fit on a node with `node` resources."""
    return min((int(node.get(k, 0.0) // v) for k, v in bundle.items() if v > 0), default=0)


def missing(bundles: list[Bundle], strategy: str, nodes: list[Bundle]) -> str | None:
    """What keeps `nodes` (each node's resources) from holding the identical `bundles`
    under `strategy`; None when they can."""
    n, one = len(bundles), bundles[0]
    need = {k: v * n for k, v in one.items()}
    have = {k: sum(r.get(k, 0.0) for r in nodes) for k in one}
    short = {k: need[k] - have[k] for k in one if have[k] < need[k]}
    if short:
        return (f"missing {_text(short)}: the job needs {_text(need)}, the cluster has "
                f"{_text(have)} on {len(nodes)} node(s)")
    caps = [_capacity(r, one) for r in nodes]
    if strategy == "STRICT_PACK" and max(caps, default=0) < n:
        return (f"STRICT_PACK puts every bundle on one node; the largest holds "
                f"{max(caps, default=0)} of the {n}")
    if strategy == "STRICT_SPREAD" and sum(c > 0 for c in caps) < n:
        return (f"STRICT_SPREAD puts each bundle on a node of its own; {sum(c > 0 for c in caps)}"
                f" node(s) hold one, {n} are needed")
    if sum(caps) < n:
        return (f"a bundle must fit on one node, and the nodes hold only {sum(caps)} of the "
                f"{n} (resources on different nodes do not add up to a bundle)")
    return None


def _what(bundles: list[Bundle], strategy: str) -> str:
    return (f"{len(bundles)} bundle(s) of {{{_text(bundles[0])}}}, one per device, "
            f"placed {strategy}")


def check_fits(bundles: list[Bundle], strategy: str) -> None:
    """RayPlacementError unless the cluster's live nodes could hold the bundles."""
    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    what = missing(bundles, strategy, nodes)
    if what is not None:
        raise RayPlacementError(f"the Ray cluster cannot hold this job's placement group "
                                f"({_what(bundles, strategy)}): {what}")


@contextlib.contextmanager
def ray_cluster(cfg: JobConfig) -> Iterator[list[Bundle]]:
    """Connected to `ray.address` in this block, having checked that the cluster can hold
    the job's bundles (one per device); yields them. Before anything starts, so a cluster
    too small stops the job with one RayPlacementError naming what is missing."""
    p = cfg.placement
    bundles = device_bundles(p.device, p.devices, p.cpu_threads)
    with ray_session(cfg.ray.address, cpus=p.devices * p.cpu_threads):
        check_fits(bundles, cfg.ray.placement_strategy)
        yield bundles


@contextlib.contextmanager
def reserve(bundles: list[Bundle], strategy: str, timeout_s: float,
            name: str = "") -> Iterator[DeviceGroup]:
    """The job's placement group, ready, for the block; removed afterwards (with the
    bundles a scale added, `DeviceGroup.grow`). A group whose resources are not free within
    `timeout_s` is a RayPlacementError (and removed)."""
    check_fits(bundles, strategy)
    pg = placement_group(bundles, strategy=strategy, name=name)
    group = DeviceGroup(pg, len(bundles), bundles[0], name)
    try:
        _wait(pg, bundles, strategy, timeout_s)
        log.info("placement group ready", bundles=len(bundles), strategy=strategy,
                 nodes=sorted(set(group.nodes().values())))
        yield group
    finally:
        for extra in [pg, *group.extra.values()]:
            remove_placement_group(extra)


def _wait(pg: PlacementGroup, bundles: list[Bundle], strategy: str, timeout_s: float) -> None:
    """Until `pg` (of `bundles`) is placed; RayPlacementError past `timeout_s`."""
    if pg.wait(timeout_seconds=timeout_s):
        return
    free = ray.available_resources()
    need = {k: v * len(bundles) for k, v in bundles[0].items()}
    short = {k: v - free.get(k, 0.0) for k, v in need.items() if free.get(k, 0.0) < v}
    raise RayPlacementError(
        f"the Ray cluster did not free this job's placement group "
        f"({_what(bundles, strategy)}) in {timeout_s:g}s (ray.placement_timeout_s): "
        f"free now {_text({k: free.get(k, 0.0) for k in need})}, missing "
        f"{_text(short) if short else 'room on single nodes'}; other jobs hold the rest")


def run_on_node(fn: Callable[..., Any], node_id: str, *args: Any) -> Any:
    """`fn(*args)` as a zero-CPU Ray task on the Ray node `node_id`; its ObjectRef."""
    on_node = NodeAffinitySchedulingStrategy(node_id, soft=False)
    return ray.remote(fn).options(num_cpus=0, scheduling_strategy=on_node).remote(*args)


def free_ports(count: int) -> list[int]:
    """`count` distinct tcp ports free on this host now (bound together, then released)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class DeviceGroup:
    """The job's placement group: bundle i holds global device i (i < `size`); a device a
    scale added beyond it (`grow`) has a one-bundle group of its own in `extra`, so a scale
    down can give it back (`release`: Ray cannot shrink a placement group)."""

    pg: PlacementGroup
    size: int = 0
    bundle_shape: Bundle = field(default_factory=dict)
    name: str = ""
    extra: dict[int, PlacementGroup] = field(default_factory=dict)

    def holds(self, device: int) -> bool:
        return 0 <= device < self.size or device in self.extra

    def bundle(self, device: int) -> tuple[PlacementGroup, int]:
        """The placement group and bundle index holding `device`."""
        return (self.extra[device], 0) if device in self.extra else (self.pg, device)

    def nodes(self) -> dict[int, str]:
        """device -> id of the Ray node holding its bundle."""
        out = dict(placement_group_table(self.pg)["bundles_to_node_id"])
        for device, pg in self.extra.items():
            out[device] = placement_group_table(pg)["bundles_to_node_id"][0]
        return out

    def address(self, device: int) -> str:
        """The IP address of the Ray node holding `device`'s bundle, as the other nodes
        reach it."""
        pg, index = self.bundle(device)
        node = placement_group_table(pg)["bundles_to_node_id"][index]
        return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node)

    def grow(self, devices: list[int], timeout_s: float) -> None:
        """Reserve a bundle (the job's bundle shape) for each of `devices`, all or none:
        RayPlacementError when the cluster cannot hold the job with them (at once) or does
        not free them within `timeout_s`. Blocks: run it off the event loop."""
        held = self.size + len(self.extra)
        nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
        what = missing([self.bundle_shape] * (held + len(devices)), "PACK", nodes)
        if what is not None:
            raise RayPlacementError(
                f"the Ray cluster cannot hold {len(devices)} more bundle(s) of "
                f"{{{_text(self.bundle_shape)}}} (devices {devices}) beside the job's {held}: "
                f"{what}")
        added = {d: placement_group([dict(self.bundle_shape)], name=f"{self.name}+{d}")
                 for d in devices}
        try:
            deadline = time.monotonic() + timeout_s
            for pg in added.values():
                _wait(pg, [self.bundle_shape] * len(devices), "beside the job's",
                      max(0.0, deadline - time.monotonic()))
        except BaseException:
            for pg in added.values():
                remove_placement_group(pg)
            raise
        self.extra.update(added)
        log.info("placement group grown", devices=devices, nodes=[self.nodes()[d] for d in
                                                                  devices])

    def release(self, devices: list[int]) -> None:
        """Give the bundles of `devices` (added by `grow`) back to the cluster."""
        for d in devices:
            remove_placement_group(self.extra.pop(d))
        if devices:
            log.info("placement group shrunk", devices=devices)

    def port_source(self, counts: dict[str, int]) -> Callable[[str], int]:
        """A function address -> a port free on that host, for `counts[address]` calls per
        address; each host is asked once (a task on its Ray node, or here)."""
        here = ray.util.get_node_ip_address()
        by_address = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
        pools: dict[str, list[int]] = {}
        for address, count in counts.items():
            if address == here or address not in by_address:
                pools[address] = free_ports(count)
                continue
            pools[address] = ray.get(run_on_node(free_ports, by_address[address], count),
                                     timeout=60)
        return lambda address: pools[address].pop()
