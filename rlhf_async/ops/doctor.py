"""`rlhf-async doctor [CONFIG] [key=value ...]`: a pre-flight of the Ray cluster a job with
`placement.launcher = ray` would run on, checked before anything starts. One line a check:

- the cluster at `ray.address` answers: its live nodes, CPUs and GPUs;
- those nodes can hold the job's placement group (one bundle per device), or what is missing;
- on every live node (a zero-CPU task pinned there): the same rlhf-async, ray, torch and
  Python as here; `run.output_dir` and `run.cache_dir` at the same path, shared (a marker
  written here is seen there) and writable: the nodes read the SFT/RM artefacts and the CURVE
  keys the coordinator makes in RUN_DIR/keys there, and write logs and checkpoints; and this
  host reachable on tcp, as the nodes reach the coordinator's control and prompt queues.

Exit 1 when any check fails. `ray` is the optional extra `[ray]`.
"""

from __future__ import annotations

import contextlib
import os
import platform
import socket
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from rlhf_async.config import JobConfig
from rlhf_async.engines.extras import require_extra
from rlhf_async.runtime.ray_cluster import (
    device_bundles,
    missing,
    ray,
    ray_session,
    run_on_node,
)

PACKAGES = ("rlhf-async", "ray", "torch")


@dataclass(frozen=True)
class Finding:
    check: str  # "ray", "placement", or a node's address
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'}  {self.check}: {self.detail}"


def versions() -> dict[str, str]:
    """This host's rlhf-async, ray, torch and Python versions ('missing' when absent)."""
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "missing"
    return out


def node_report(markers: dict[str, str], address: str, port: int) -> dict[str, Any]:
    """Run on one Ray node: its versions; for each path name, whether the marker file
    written at `markers[name]` by the driver is seen here and its directory writable; and
    whether `address:port` (the driver's host) accepts tcp from here."""
    paths = {}
    for name, marker in markers.items():
        seen = os.path.exists(marker)
        writable = False
        if seen:
            with contextlib.suppress(OSError), tempfile.NamedTemporaryFile(
                    dir=os.path.dirname(marker), prefix=".rlhf-async-doctor-"):
                writable = True
        paths[name] = {"seen": seen, "writable": writable}
    try:
        socket.create_connection((address, port), timeout=5.0).close()
        reach = ""
    except OSError as e:
        reach = e.strerror or str(e)
    return {"versions": versions(), "paths": paths, "reach": reach,
            "host": socket.gethostname()}


def node_findings(where: str, report: dict[str, Any], expected: dict[str, str],
                  dirs: dict[str, str], coordinator: str) -> list[Finding]:
    """The problems `report` (from `node_report` on the node at `where`) shows against this
    host's `expected` versions, the shared `dirs` (name -> path) and the coordinator's
    `coordinator` address; one ok line when there are none."""
    out = []
    differ = {k: v for k, v in report["versions"].items() if v != expected.get(k)}
    if differ:
        out.append(Finding(where, False, "versions differ from this host's: " + ", ".join(
            f"{k} {v} there, {expected.get(k)} here" for k, v in sorted(differ.items()))))
    for name, seen in report["paths"].items():
        if not seen["seen"]:
            out.append(Finding(where, False, f"{name} {dirs[name]} is not this host's "
                               "directory there (no shared filesystem at that path); every "
                               "node needs it at the same path"))
        elif not seen["writable"]:
            out.append(Finding(where, False, f"{name} {dirs[name]} is not writable there"))
    if report["reach"]:
        out.append(Finding(where, False, f"cannot reach this host at {coordinator} over tcp "
                           f"({report['reach']}); nodes must reach each other on any tcp "
                           "port (firewall?)"))
    if not out:
        shared = ", ".join(dirs)
        out.append(Finding(where, True, f"{report['host']}: same versions, {shared} shared "
                           "and writable, this host reachable"))
    return out


@contextlib.contextmanager
def _markers(dirs: dict[str, str]) -> Iterator[dict[str, str]]:
    """A fresh marker file in each directory (made if absent), removed afterwards."""
    token = f".rlhf-async-doctor-{uuid.uuid4().hex}"
    made = {}
    try:
        for name, path in dirs.items():
            Path(path).mkdir(parents=True, exist_ok=True)
            made[name] = str(Path(path) / token)
            Path(made[name]).touch()
        yield made
    finally:
        for marker in made.values():
            Path(marker).unlink(missing_ok=True)


@contextlib.contextmanager
def _listening() -> Iterator[int]:
    """A tcp port listening on every interface of this host for the block."""
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen(64)  # the kernel completes connects without an accept
        yield int(s.getsockname()[1])


def check_cluster(cfg: JobConfig, timeout_s: float = 60.0) -> list[Finding]:
    """Every check above, for `cfg`'s cluster, placement and directories."""
    require_extra("rlhf-async doctor", "ray", "ray")
    p = cfg.placement
    bundles = device_bundles(p.device, p.devices, p.cpu_threads)
    dirs = {"run.output_dir": str(Path(cfg.run.output_dir).resolve()),
            "run.cache_dir": str(Path(cfg.run.cache_dir).resolve())}
    with ray_session(cfg.ray.address):
        nodes = [n for n in ray.nodes() if n["Alive"]]
        total = ray.cluster_resources()
        out = [Finding("ray", True, f"{cfg.ray.address}: {len(nodes)} live node(s), "
                       f"{total.get('CPU', 0):g} CPU, {total.get('GPU', 0):g} GPU")]
        short = missing(bundles, cfg.ray.placement_strategy, [n["Resources"] for n in nodes])
        out.append(Finding("placement", short is None,
                           f"{len(bundles)} bundle(s) of {bundles[0]} placed "
                           f"{cfg.ray.placement_strategy}: " + (short or "the nodes hold them")))
        here = ray.util.get_node_ip_address()
        with _markers(dirs) as markers, _listening() as port:
            out += _probe_nodes(nodes, markers, here, port, dirs, timeout_s)
    return out


def _probe_nodes(nodes: list[dict[str, Any]], markers: dict[str, str], here: str, port: int,
                 dirs: dict[str, str], timeout_s: float) -> list[Finding]:
    refs = {f"{n['NodeManagerAddress']} ({n['NodeID'][:8]})":
            run_on_node(node_report, n["NodeID"], markers, here, port) for n in nodes}
    expected, out = versions(), []
    for where, ref in refs.items():
        try:
            report = ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            out.append(Finding(where, False, f"did not answer in {timeout_s:g}s (--timeout)"))
            continue
        except ray.exceptions.RayError as e:
            first = str(e).strip().splitlines()[-1][:300]
            out.append(Finding(where, False, f"cannot run rlhf-async there ({first}); "
                               "install rlhf-async[ray] on every node"))
            continue
        out += node_findings(where, report, expected, dirs, f"{here}:{port}")
    return out
