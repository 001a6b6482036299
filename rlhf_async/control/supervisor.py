"""Node lifecycle: launch each node, wait for it to be ready, declare it dead, restart it.

The coordinator owns one `Supervisor` and feeds it what the control plane hears (a node's
`last_seen` on every message, `ready` on its handshake); the supervisor never touches a
socket. Each `check` declares a node dead when its process exited with an error, its
heartbeats stopped for `time_to_dead`, or it was not ready within `ready_timeout`. A dead
node is killed (a hung one must not linger beside its replacement) and started again while
it has restarts left and no stop is under way. What it sees it tells the coordinator's
listeners through `publish`: exited, node_dead, node_restarted.

Restarts are counted the way jupyter_client's restarter counts them: `restart_limit` bounds
a node's *consecutive* failures, and the count starts over once the node has been ready and
heard from for `stable_after_s`. A week-long job whose node dies once an hour never runs
out of restarts; a node that crash-loops does, after `restart_limit` tries.

Each start of a node is a new incarnation (`NodeSpec.incarnation`, 0 for the first); the
node's control identity carries it (`NodeSpec.peer_id`), so a process declared dead that
wakes up later (SIGCONT of a frozen node, a partitioned host coming back) is no longer the
node: the coordinator rejects and counts what it sends.

Nodes on this host beat into a shared board (`board`, runtime/beats.py) instead of sending
messages: each start gets a slot of its own, read in each `check`; the supervisor stamps
the coordinator's slot on each pass of `watch`, which the nodes read as its answer.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rlhf_async.control.client import (
    NodeDead,
    NodeEvent,
    NodeExited,
    NodeNotReady,
    NodeRestarted,
)
from rlhf_async.runtime.beats import COORDINATOR, BeatBoard
from rlhf_async.runtime.launcher import Launcher, NodeProcess, last_log_line
from rlhf_async.runtime.messages import tag, to_payload
from rlhf_async.runtime.spec import NodeSpec


@dataclass
class NodeRecord:
    """One node id and its current process (a restart replaces `process`, not the record's
    id); `last_seen` is stamped by the control plane on every message from the node."""

    spec: NodeSpec
    process: NodeProcess
    started: float
    last_seen: float
    state: str = "starting"  # starting | ready | exited | dead | retiring
    restarts: int = 0  # every restart of the run, for status and metrics
    failures: int = 0  # consecutive deaths: what restart_limit bounds
    healthy_since: float | None = None  # first seen ready (by `check`) since this start
    exit_code: int | None = None
    goodbye: dict[str, Any] | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    def mark_ready(self) -> None:
        self.state = "ready"
        self.ready.set()


class Supervisor:
    def __init__(self, run_dir: Path, launcher: Launcher, *,
                 publish: Callable[[NodeEvent], None], stopping: Callable[[], bool],
                 time_to_dead: float, ready_timeout: float, restart_limit: int,
                 log: Any, stable_after_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic,
                 board: BeatBoard | None = None) -> None:
        self.run_dir, self.launcher = run_dir, launcher
        self.time_to_dead, self.ready_timeout = time_to_dead, ready_timeout
        self.restart_limit, self.stable_after_s = restart_limit, stable_after_s
        self.clock = clock  # the coordinator stamps `last_seen` with time.monotonic too
        self.nodes: dict[str, NodeRecord] = {}
        self._publish, self._stopping = publish, stopping
        self.log = log
        self._closed = False  # shutting down: no more deaths declared, no restarts
        # heartbeats of the nodes on this host (runtime/beats.py): a slot per start
        self.board, self._slots = board, itertools.count(COORDINATOR + 1)

    def start(self, spec: NodeSpec, restarts: int = 0, failures: int = 0) -> None:
        spec = replace(spec, incarnation=restarts, beats="", beat_slot=0)
        now = self.clock()
        if self.board is not None and (slot := next(self._slots)) < self.board.slots:
            self.board.stamp(slot, now)
            spec = replace(spec, beats=self.board.path, beat_slot=slot)
        process = self.launcher.launch(spec, self.run_dir)
        node = NodeRecord(spec, process, now, now, restarts=restarts, failures=failures)
        self.nodes[spec.node_id] = node
        self.log.info("node_launched", node=spec.node_id, role=spec.role, pid=process.pid,
                      incarnation=spec.incarnation)
        self._watch_exit(node)

    def _watch_exit(self, node: NodeRecord) -> None:
        """A process with a `sentinel` (a descriptor readable once it has ended: a forked
        node's) is checked the moment it ends, so `watch` need not poll often for a fast
        restart; one without (exec, Ray) waits for the next `check`."""
        fd = getattr(node.process, "sentinel", None)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # started outside an event loop (a test's fake launcher)
            return
        if fd is not None:
            loop.add_reader(fd, self._ended, loop, fd, node)

    def _ended(self, loop: asyncio.AbstractEventLoop, fd: int, node: NodeRecord) -> None:
        loop.remove_reader(fd)
        if not self._closed and self.nodes.get(node.spec.node_id) is node:
            self._check_node(node, self.clock())

    def _will_restart(self, node: NodeRecord) -> bool:
        return node.failures < self.restart_limit and not self._stopping()

    async def wait_ready(self, node_ids: list[str] | None = None,
                         timeout: float | None = None) -> None:
        """Wait until the nodes are ready; NodeNotReady names any node that never came up."""
        ids = list(self.nodes) if node_ids is None else node_ids
        deadline = time.monotonic() + (timeout or self.ready_timeout)
        while True:
            waiting = [i for i in ids if self.nodes[i].state != "ready"]
            if not waiting:
                return
            for i in waiting:
                node = self.nodes[i]
                gone = node.state in ("dead", "exited") or node.process.poll() is not None
                # a death during start-up is restarted like any other (`check` does it)
                restarting = node.state != "exited" and self._will_restart(node)
                if gone and not restarting:
                    rc = node.process.poll()
                    words = self.last_words(node, rc)
                    raise NodeNotReady(f"node {i!r} exited with code {rc} before it was "
                                       f"ready" + (f" ({words})" if words else "")
                                       + f"; see {self.log_hint(node)}")
            if time.monotonic() > deadline:
                hints = ", ".join(f"{i} ({self.log_hint(self.nodes[i])})" for i in waiting)
                raise NodeNotReady(f"nodes not ready after {timeout or self.ready_timeout}s: "
                                   f"{hints}")
            await asyncio.sleep(0.05)

    def log_hint(self, node: NodeRecord) -> str:
        return str(getattr(node.process, "log_path", "its log"))

    @staticmethod
    def last_words(node: NodeRecord, rc: int | None) -> str:
        """A crashed node's last log line ("" for a killed one, which writes none)."""
        path = getattr(node.process, "log_path", None)
        return last_log_line(path) if path is not None and rc is not None and rc > 0 else ""

    async def watch(self, period: float) -> None:
        """`check` every `period` seconds until `close`; stamp the coordinator's slot of the
        board until cancelled (nodes given a grace to stop read it meanwhile)."""
        while True:
            await asyncio.sleep(period)
            if self.board is not None:  # we live: what the nodes here read as our answer
                self.board.stamp(COORDINATOR, self.clock())
            if not self._closed:
                self.check()

    def check(self) -> None:
        """One liveness pass over every node still starting or ready."""
        now = self.clock()
        for node in list(self.nodes.values()):
            self._check_node(node, now)

    def _check_node(self, node: NodeRecord, now: float) -> None:
        if node.state in ("dead", "exited", "retiring"):
            return
        if node.spec.beats and self.board is not None:  # its beats, written in place
            node.last_seen = max(node.last_seen, self.board.read(node.spec.beat_slot))
        self._note_health(node, now)
        rc = node.process.poll()
        if rc == 0:  # finished or stopped on request: not a failure
            node.state, node.exit_code = "exited", 0
            self._publish(NodeEvent(node.spec.node_id, tag(NodeExited), node.goodbye))
        elif rc is not None:
            # a node that could not say goodbye (a crash) leaves its last word in its log
            reason = (node.goodbye or {}).get("reason", "") or self.last_words(node, rc)
            why = f"exited with code {rc}" + (f" ({reason})" if reason else "")
            self._dead(node, why, rc)
        elif node.state == "ready" and now - node.last_seen > self.time_to_dead:
            self._dead(node, f"no heartbeat for {now - node.last_seen:.1f}s", None)
        elif node.state == "starting" and now - node.started > self.ready_timeout:
            self._dead(node, f"not ready after {self.ready_timeout}s", None)

    def _note_health(self, node: NodeRecord, now: float) -> None:
        """A node ready and heard from for `stable_after_s` has its failures forgiven."""
        if node.state != "ready" or now - node.last_seen > self.time_to_dead:
            return
        if node.healthy_since is None:
            node.healthy_since = now
        elif node.failures and now - node.healthy_since >= self.stable_after_s:
            self.log.info("node_stable", node=node.spec.node_id, failures=node.failures,
                          stable_s=round(now - node.healthy_since, 1))
            node.failures = 0

    def pid(self, node_id: str) -> int | None:
        """The pid of the node's current process while it runs; None once it is gone."""
        node = self.nodes.get(node_id)
        if node is None or node.state in ("dead", "exited") or node.process.poll() is not None:
            return None
        return node.process.pid

    def restart(self, node_id: str, reason: str, pid: int) -> bool:
        """Kill `node_id` and start it again (within restart_limit) as if it had died. Only
        the process the caller means (`pid`) is killed: a replacement started meanwhile is
        left alone. True if it was killed."""
        if self.pid(node_id) != pid:
            return False
        self._dead(self.nodes[node_id], reason, None)
        return True

    def _dead(self, node: NodeRecord, reason: str, rc: int | None) -> None:
        node_id = node.spec.node_id
        node.state, node.exit_code = "dead", rc
        node.process.kill()  # a hung node must not linger beside its replacement
        restart = self._will_restart(node)
        self.log.error("node_dead", node=node_id, role=node.spec.role, reason=reason,
                       restart=restart, log=self.log_hint(node))
        self._publish(NodeEvent(node_id, tag(NodeDead),
                                to_payload(NodeDead(reason, restart, rc, node.process.pid))))
        if restart:
            self.start(node.spec, restarts=node.restarts + 1, failures=node.failures + 1)
            self._publish(NodeEvent(node_id, tag(NodeRestarted),
                                    to_payload(NodeRestarted(node.restarts + 1))))

    async def retire(self, node_id: str, grace: float) -> int | None:
        """Take `node_id` out of the job (it was asked to stop: the job scaled down): its
        exit is no death and starts nothing; past `grace` it is terminated, then killed.
        The record is forgotten, so the id may be started again later. Its exit code."""
        node = self.nodes[node_id]
        node.state = "retiring"
        for action in ("terminate", "kill"):
            if (rc := await node.process.wait(timeout=grace)) is not None:
                break
            self.log.warning("node_" + action, node=node_id, pid=node.process.pid)
            getattr(node.process, action)()
        else:
            rc = await node.process.wait(timeout=grace)
        del self.nodes[node_id]
        self.log.info("node_retired", node=node_id, role=node.spec.role, exit_code=rc)
        return rc

    def close(self) -> None:
        """From now on no node is declared dead or restarted: the job is shutting down."""
        self._closed = True

    def alive(self) -> list[NodeRecord]:
        return [n for n in self.nodes.values() if n.process.poll() is None]

    async def shut_down(self, grace: float, force: asyncio.Event) -> None:
        """Give the live nodes `grace` to exit, then terminate, then kill; `force` cuts each
        grace short."""
        self.close()
        alive = self.alive()
        for action in ("terminate", "kill"):
            deadline = time.monotonic() + grace
            while alive and time.monotonic() < deadline and not force.is_set():
                alive = [n for n in alive if n.process.poll() is None]
                await asyncio.sleep(0.02)
            for n in alive:
                self.log.warning("node_" + action, node=n.spec.node_id, pid=n.process.pid)
                getattr(n.process, action)()
        for n in alive:
            await n.process.wait(timeout=grace)

    def status(self) -> dict[str, dict[str, Any]]:
        now = self.clock()
        return {
            i: {"role": n.spec.role, "pid": n.process.pid, "state": n.state,
                "last_seen_s": round(now - n.last_seen, 2), "restarts": n.restarts,
                "failures": n.failures, "incarnation": n.spec.incarnation,
                "exit_code": n.exit_code}
            for i, n in self.nodes.items()
        }
