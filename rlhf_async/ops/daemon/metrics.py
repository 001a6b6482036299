"""Prometheus `/metrics` for the daemon (prometheus-client), on a localhost port.

Series (documented in deploy/README.md; labels in braces):

    rlhf_daemon_jobs{state}                 jobs per state (queued, running, ...)
    rlhf_job_step{job}                      last step in the running job's metrics.jsonl
    rlhf_job_samples_per_second{job}        samples/s of that step
    rlhf_job_mfu{job,stage}                 model FLOPs utilization of that step (0..1) per
                                            stage (generate, score, train) and the step
    rlhf_job_tokens_per_second_per_device{job}  prompt + response tokens/s per device
    rlhf_job_queue_depth{job,queue}         Separation queues (dispatched, generated,
                                            scored, trainer)
    rlhf_job_staleness{job,stat}            rollout staleness statistics of that step
    rlhf_job_weight_sync_seconds{job}       last weight broadcast time
    rlhf_job_node_up{job,node,role}         1 when the coordinator reports the node ready

Every scrape reads the tail of each running job's RUN_DIR/metrics.jsonl and asks its
coordinator (RUN_DIR/coordinator.json, when the strategy has one) for node states.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.core import CollectorRegistry, GaugeMetricFamily
from prometheus_client.registry import Collector

from rlhf_async.log import get_logger
from rlhf_async.ops.daemon.store import JobStore

log = get_logger(component="daemon.metrics")
TAIL_BYTES = 65536


def last_record(path: Path) -> dict[str, Any] | None:
    """The last complete JSON line of a metrics file, or None."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - TAIL_BYTES))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written, or cut by the tail window
        if isinstance(record, dict):
            return record
    return None


def node_states(run_dir: Path, timeout: float = 1.0) -> dict[str, dict[str, Any]]:
    """The coordinator's node table, or {} when there is no coordinator to ask."""
    # torch (control/'s messages): the daemon loads it only when it asks a coordinator
    from rlhf_async.control.client import CoordinatorError, call_coordinator, read_coordinator_file

    try:
        info = read_coordinator_file(run_dir)
        status = asyncio.run(call_coordinator(info["control"], "status", timeout=timeout,
                                              keys=info.get("keys")))
    except (CoordinatorError, TimeoutError, OSError, ValueError) as e:
        log.debug("no node states", run_dir=str(run_dir), reason=str(e))
        return {}
    return status.get("nodes", {}) if isinstance(status, dict) else {}


class JobCollector(Collector):
    def __init__(self, db_path: Path) -> None:
        self.db_path = db_path

    def collect(self) -> Iterator[GaugeMetricFamily]:
        store = JobStore(self.db_path)  # its own connection: scrapes run on another thread
        try:
            counts, running = store.counts(), store.list(("running",))
        finally:
            store.close()
        jobs = GaugeMetricFamily("rlhf_daemon_jobs", "jobs per state", labels=["state"])
        for state, n in counts.items():
            jobs.add_metric([state], n)
        yield jobs
        fams = {name: GaugeMetricFamily(name, text, labels=labels) for name, text, labels in (
            ("rlhf_job_step", "last trained step", ["job"]),
            ("rlhf_job_samples_per_second", "samples per second", ["job"]),
            ("rlhf_job_mfu", "model FLOPs utilization (0..1)", ["job", "stage"]),
            ("rlhf_job_tokens_per_second_per_device", "tokens per second per device",
             ["job"]),
            ("rlhf_job_queue_depth", "items per pipeline queue", ["job", "queue"]),
            ("rlhf_job_staleness", "rollout staleness (weight versions)", ["job", "stat"]),
            ("rlhf_job_weight_sync_seconds", "last weight sync time", ["job"]),
            ("rlhf_job_node_up", "node ready (1) or not (0)", ["job", "node", "role"]))}
        for job in running:
            self._job_samples(str(job.id), Path(job.run_dir), fams)
        yield from fams.values()

    def _job_samples(self, job: str, run_dir: Path, fams: dict[str, GaugeMetricFamily]) -> None:
        rec = last_record(run_dir / "metrics.jsonl")
        if rec is not None:
            simple = (("rlhf_job_step", "step"), ("rlhf_job_samples_per_second", "samples_per_s"),
                      ("rlhf_job_weight_sync_seconds", "weight_sync_s"),
                      ("rlhf_job_tokens_per_second_per_device", "tokens_per_s_per_device"))
            for name, key in simple:
                if isinstance(rec.get(key), (int, float)):
                    fams[name].add_metric([job], float(rec[key]))
            for key, value in rec.items():
                if not isinstance(value, (int, float)):
                    continue
                if key.startswith("queue/"):
                    fams["rlhf_job_queue_depth"].add_metric([job, key[6:]], float(value))
                elif key.startswith("staleness/"):
                    fams["rlhf_job_staleness"].add_metric([job, key[10:]], float(value))
                elif key.startswith("mfu/"):
                    fams["rlhf_job_mfu"].add_metric([job, key[4:]], float(value))
        for node, n in node_states(run_dir).items():
            up = 1.0 if n.get("state") == "ready" else 0.0
            fams["rlhf_job_node_up"].add_metric([job, node, str(n.get("role", ""))], up)


def serve_metrics(db_path: Path, port: int, addr: str = "127.0.0.1") -> None:
    """Start the /metrics HTTP server on a daemon thread."""
    registry = CollectorRegistry()
    registry.register(JobCollector(db_path))
    start_http_server(port, addr=addr, registry=registry)
