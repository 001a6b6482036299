"""Chaos monkey for a running job: SIGKILL its nodes every few trained steps, or in their
first seconds (start-up: model loading, before the ready handshake or just after it), or
SIGSTOP them (a frozen node: alive, silent) and time how long until they are replaced.

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


def _ready_after(run_dir: Path, node: str, min_steps: int) -> tuple[int, int] | None:
    """(steps trained, pid) once `min_steps` steps are trained and `node` is ready; None
    before (the job not up yet, or the node restarting from an earlier fault)."""
    metrics = run_dir / "metrics.jsonl"
    steps = len(metrics.read_text().splitlines()) if metrics.exists() else 0
    if steps < min_steps:
        return None
    try:
        status = _nodes(run_dir).get(node, {})
    except Exception:  # not up yet, or shutting down: try again
        return None
    if status.get("state") != "ready" or not status.get("pid"):
        return None
    return steps, status["pid"]


def kill_nodes(run_dir: str | Path, order: list[str], every_steps: int,
               stop: threading.Event, victims: list[tuple[str, int]]) -> None:
    """Kill `order[i]` once `2 + every_steps * i` steps are trained and it is up; appends
    (node, steps trained) to `victims`. Returns when done or when `stop` is set."""
    while len(victims) < len(order) and not stop.is_set():
        time.sleep(0.1)
        victim = order[len(victims)]
        up = _ready_after(Path(run_dir), victim, 2 + every_steps * len(victims))
        if up is None:
            continue
        try:
            os.kill(up[1], signal.SIGKILL)
        except ProcessLookupError:
            continue
        victims.append((victim, up[0]))


def freeze_nodes(run_dir: str | Path, order: list[str], every_steps: int,
                 stop: threading.Event, victims: list[dict]) -> None:
    """SIGSTOP `order[i]` once `1 + every_steps * i` steps are trained and it is up, wait
    until a new process of it is ready, then SIGCONT the frozen one (declared dead, it must
    be gone). Appends per victim: node, steps trained, the frozen pid, `restart_s` (SIGSTOP
    to the replacement's launch), `ready_s` (to its ready handshake) and `woke` (what the
    SIGCONT found: "gone", or "running" for a process the coordinator failed to kill)."""
    while len(victims) < len(order) and not stop.is_set():
        time.sleep(0.05)
        up = _ready_after(Path(run_dir), order[len(victims)], 1 + every_steps * len(victims))
        if up is None:
            continue
        t0 = time.monotonic()
        try:
            os.kill(up[1], signal.SIGSTOP)
        except ProcessLookupError:
            continue
        victim = {"node": order[len(victims)], "steps": up[0], "pid": up[1]}
        victims.append(victim)
        _replaced(Path(run_dir), victim, t0, stop)


def _replaced(run_dir: Path, victim: dict, t0: float, stop: threading.Event) -> None:
    while not stop.is_set() and "ready_s" not in victim:
        time.sleep(0.05)
        try:
            node = _nodes(run_dir).get(victim["node"], {})
        except Exception:  # the coordinator is busy or gone
            continue
        if node.get("pid") not in (None, victim["pid"]):
            victim.setdefault("restart_s", round(time.monotonic() - t0, 2))
            if node.get("state") == "ready":
                victim["ready_s"] = round(time.monotonic() - t0, 2)
    try:
        os.kill(victim["pid"], signal.SIGCONT)
        alive = psutil.Process(victim["pid"]).status() != psutil.STATUS_ZOMBIE
        victim["woke"] = "running" if alive else "gone"
    except (ProcessLookupError, psutil.NoSuchProcess):
        victim["woke"] = "gone"


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
    """Kill each node of `order` in turn while it starts (the first launch, or the restart
    an earlier kill caused): not yet ready, however long a loaded host takes, or within
    `within_s` seconds of its process starting (a node may report ready before it loads its
    models); appends (node, age of its process in s)."""
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
            if age > within_s and node.get("state") != "starting":
                continue  # too late for this incarnation; wait for a restart
            os.kill(pid, signal.SIGKILL)
        except (psutil.NoSuchProcess, ProcessLookupError):
            continue
        killed.add(pid)
        victims.append((order[len(victims)], round(age, 2)))


def kill_random(run_dir: str | Path, kills: int, every_steps: int, stop: threading.Event,
                victims: list[tuple[str, int]], seed: int = 0) -> None:
    """SIGKILL a random ready node every `every_steps` trained steps (from step 2), `kills`
    times: whichever nodes the job has then (a scaled job's change). Appends (node, steps
    trained) to `victims`."""
    rng, run_dir, at = random.Random(seed), Path(run_dir), 2
    while len(victims) < kills and not stop.is_set():
        time.sleep(0.1)
        metrics = run_dir / "metrics.jsonl"
        steps = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        if steps < at:
            continue
        try:
            nodes = _nodes(run_dir)
        except Exception:  # the coordinator is busy or gone: try again
            continue
        ready = sorted((n, s["pid"]) for n, s in nodes.items()
                       if s.get("state") == "ready" and s.get("pid"))
        if not ready:
            continue
        node, pid = rng.choice(ready)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        victims.append((node, steps))
        at = steps + every_steps
