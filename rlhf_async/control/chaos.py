"""Chaos monkey for a running job: SIGKILL its nodes every few trained steps, or in their
first seconds (start-up: model loading, before the ready handshake or just after it).

Used by the chaos test and `bench/chaos.py`; it reads the job's progress from
RUN_DIR/metrics.jsonl and its nodes from the coordinator's status (RUN_DIR/coordinator.json).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time
from pathlib import Path

import psutil

from rlhf_async.control.client import call_coordinator, read_coordinator_file


def _nodes(run_dir: Path) -> dict:
    info = read_coordinator_file(run_dir)
    status = asyncio.run(call_coordinator(info["control"], "status", timeout=2.0,
                                          keys=info.get("keys")))
    return status["nodes"]


def kill_nodes(run_dir: str | Path, order: list[str], every_steps: int,
               stop: threading.Event, victims: list[tuple[str, int]]) -> None:
    """Kill `order[i]` once `2 + every_steps * i` steps are trained and it is up; appends
    (node, steps trained) to `victims`. Returns when done or when `stop` is set."""
    metrics = Path(run_dir) / "metrics.jsonl"
    while len(victims) < len(order) and not stop.is_set():
        time.sleep(0.1)
        steps = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        if steps < 2 + every_steps * len(victims):
            continue
        try:
            nodes = _nodes(Path(run_dir))
        except Exception:  # not up yet, or shutting down: try again
            continue
        victim = order[len(victims)]
        node = nodes.get(victim, {})
        if node.get("state") != "ready" or not node.get("pid"):
            continue  # still restarting from an earlier kill
        try:
            os.kill(node["pid"], signal.SIGKILL)
        except ProcessLookupError:
            continue
        victims.append((victim, steps))


def random_order(nodes: list[str], kills: int, seed: int = 0) -> list[str]:
    """`kills` victims covering every node before repeating, in a seeded random order."""
    rng, order = random.Random(seed), list[str]()
    while len(order) < kills:
        batch = list(nodes)
        rng.shuffle(batch)
        order += batch
    return order[:kills]


def kill_at_start(run_dir: str | Path, order: list[str], stop: threading.Event,
                  victims: list[tuple[str, float]], within_s: float = 3.0) -> None:
    """Kill each node of `order` in turn within `within_s` seconds of its process starting
    (the first launch, or the restart an earlier kill caused); appends (node, age in s)."""
    killed: set[int] = set()
    while len(victims) < len(order) and not stop.is_set():
        time.sleep(0.02)
        try:
            node = _nodes(Path(run_dir)).get(order[len(victims)], {})
        except Exception:  # the coordinator is not up yet
            continue
        pid = node.get("pid")
        if not pid or pid in killed:
            continue
        try:
            age = time.time() - psutil.Process(pid).create_time()
            if age > within_s:
                continue  # too late for this incarnation; wait for a restart
            os.kill(pid, signal.SIGKILL)
        except (psutil.NoSuchProcess, ProcessLookupError):
            continue
        killed.add(pid)
        victims.append((order[len(victims)], round(age, 2)))
