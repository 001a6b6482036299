"""Coordinator: holds the control plane, launches node processes, and always cleans up.

    async with Coordinator(run_dir) as coord:
        await coord.launch(specs)                    # returns once every node is ready
        status = await coord.call("gen0", Status())   # a typed command, its typed reply
        async for event in coord.events(): ...       # app events + node_dead / node_restarted

Nodes connect a DEALER (identity = node_id#incarnation, `NodeSpec.peer_id`) to the
coordinator's ROUTER and beat every `heartbeat_s` (`time_to_dead` / 5 unless given; written
into each spec it launches): on this host into a shared board (runtime/beats.py), where they
also read the coordinator's stamp, elsewhere over the socket, answered only when a node asks
(silent a third of its `orphan_timeout_s`): a node notices a vanished coordinator by itself.
A hung node is dead at most `time_to_dead` + 0.5 s after it hangs. `RUN_DIR/coordinator.json`
names the control endpoint for the CLI's `status` and `stop`. The nodes' lives (launch, ready,
liveness, restarts) are its `Supervisor`'s (supervisor.py), told what the socket hears.

Security: the control socket is an owner-only ipc file. Nodes get the coordinator's CURVE
keys directory (`keys=`) in their spec; a spec using tcp without keys gets a fresh set in
RUN_DIR/keys, so tcp between nodes is never plaintext unless `insecure=True`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import time
from collections.abc import Callable, Coroutine
from dataclasses import replace
from pathlib import Path
from typing import Any, Self, TypeVar

import structlog

from rlhf_async.control.client import (
    COORDINATOR_FILE,
    CommandError,
    CoordinatorError,
    EventStream,
    NodeEvent,
    NodeNotReady,
    NodeReady,
    call_coordinator,
    read_coordinator_file,
)
from rlhf_async.control.supervisor import NodeRecord, Supervisor
from rlhf_async.runtime.beats import BeatBoard
from rlhf_async.runtime.ipc_dir import make_ipc_dir
from rlhf_async.runtime.launcher import Launcher, LocalLauncher
from rlhf_async.runtime.loop import in_main_thread
from rlhf_async.runtime.messages import (
    Command,
    Handlers,
    MessageError,
    Readdress,
    Status,
    Stop,
    Stopping,
    decode_reply,
    tag,
    to_payload,
)
from rlhf_async.runtime.spec import NodeSpec
from rlhf_async.wire.protocol import Message
from rlhf_async.wire.security import Keyring, generate_keys
from rlhf_async.wire.transport import IPC_PATH_MAX, Endpoint, Transport

__all__ = ["COORDINATOR_FILE", "CommandError", "Coordinator", "CoordinatorError", "EventStream",
           "NodeEvent", "NodeNotReady", "call_coordinator", "read_coordinator_file"]
T = TypeVar("T")
R = TypeVar("R")
BEAT_SLOTS = 4096  # node starts with a heartbeat slot; later ones beat over the socket


class Coordinator:
    def __init__(self, run_dir: str | Path, *, launcher: Launcher | None = None,
                 control: str | None = None, heartbeat_s: float | None = None,
                 time_to_dead: float = 5.0, ready_timeout: float = 120.0,
                 restart_limit: int = 0, stable_after_s: float = 300.0, stop_timeout: float = 5.0,
                 keys: str | Path | None = None, insecure: bool = False) -> None:
        self.run_dir = Path(run_dir).resolve()
        # CURVE keys for tcp (ours and the nodes'); made on first need when not given
        self.keyring = Keyring.load(keys) if keys is not None else None
        self.insecure = insecure
        self._ctl_dir: str | None = None
        self.control = control
        # five beats to miss before a node is dead: slack for a loaded host, few messages
        self.heartbeat_s = heartbeat_s or time_to_dead / 5
        self.stop_timeout = stop_timeout
        self.log = structlog.get_logger().bind(role="coordinator")
        self.stop_requested = asyncio.Event()
        self._beat_dir: str | None = None
        self.supervisor = Supervisor(
            self.run_dir, launcher or LocalLauncher(), publish=self._publish,
            stopping=self.stop_requested.is_set, time_to_dead=time_to_dead,
            ready_timeout=ready_timeout, restart_limit=restart_limit, log=self.log,
            stable_after_s=stable_after_s)
        self._force = asyncio.Event()  # a second signal: no more grace
        self.stop_reason = ""
        self._transport = Transport(log=self.log, keys=self.keyring, insecure=insecure)
        self._pending: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._listeners: list[Callable[[NodeEvent], Any]] = []
        # coordinator-level commands, from nodes and the CLI (`call_coordinator`)
        self._handlers = Handlers(self.log)
        self._handlers.add(Status, lambda _: self.status())
        self._handlers.add(Stop, lambda cmd: self.request_stop(f"command: {cmd.reason}"))
        # the control socket's wire kinds (wire/protocol.py CONTROL_KINDS) from a known node
        self._from_node: dict[str, Callable[[bytes, Message, NodeRecord], Any]] = {
            "heartbeat": self._heartbeat, "reply": self._reply, "ready": self._ready,
            "event": self._event, "stop": self._goodbye}
        self._started = time.monotonic()
        self._stopped = False
        self._following: set[asyncio.Task[Any]] = set()  # peers told of a moved node

    @property
    def counters(self) -> dict[str, int]:
        return dict(self._transport.counters)

    # the supervisor's, read through the coordinator by runners, tests and benches
    @property
    def nodes(self) -> dict[str, NodeRecord]:
        return self.supervisor.nodes

    @property
    def ready_timeout(self) -> float:
        return self.supervisor.ready_timeout

    # async with: bind the control socket, start the loops; always clean up
    async def __aenter__(self) -> Self:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.control is None:
            path = str(self.run_dir / "ctl.sock")
            if len(path) > IPC_PATH_MAX:  # a short private directory keeps control on ipc
                self._ctl_dir = make_ipc_dir()  # swept if this process is SIGKILLed
                path = os.path.join(self._ctl_dir, "ctl.sock")
            self.control = f"ipc://{path}"
        elif self.control.startswith("tcp://") and not self.insecure:
            self._ensure_keys()
        if getattr(self.supervisor.launcher, "same_host", False):
            # the nodes it starts on our host beat into a shared board (runtime/beats.py)
            self._beat_dir = make_ipc_dir()
            self.supervisor.board = BeatBoard.create(os.path.join(self._beat_dir, "beats"),
                                                     BEAT_SLOTS)
        try:
            self._router = self._transport.channel(
                Endpoint("router", self.control, bind=True, hwm=10000))
        except Exception:
            await self._transport.close()
            raise
        self._transport.spawn(self._control_loop(), name="coordinator-control")
        self._transport.spawn(self.supervisor.watch(min(self.heartbeat_s / 2, 0.5)),
                              name="coordinator-monitor")
        info = {"control": self.control, "pid": os.getpid(), "run_dir": str(self.run_dir),
                "keys": self.keyring.directory if self.keyring else None}
        tmp = self.run_dir / f".{COORDINATOR_FILE}.tmp"
        tmp.write_text(json.dumps(info))
        tmp.replace(self.run_dir / COORDINATOR_FILE)
        self.log.info("coordinator_started", control=self.control, run_dir=str(self.run_dir))
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.stop()
        finally:
            await self._transport.close()
            (self.run_dir / COORDINATOR_FILE).unlink(missing_ok=True)
            for private in (self._ctl_dir, self._beat_dir):
                if private is not None:
                    shutil.rmtree(private, ignore_errors=True)
            if self.supervisor.board is not None:
                self.supervisor.board.close()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                if in_main_thread():
                    loop.remove_signal_handler(sig)

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT set `stop_requested`; `async with` exit then stops every node,
        giving each its grace to finish (the trainer writes its checkpoint). A second
        signal while stopping cuts the grace short: nodes are killed at once. Off the main
        thread (run from inside a running event loop, e.g. Jupyter) there are none to
        install: the caller's thread gets the signals (`run_loop`)."""
        if not in_main_thread():
            return
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, signal.Signals(sig).name)

    def _on_signal(self, name: str) -> None:
        if self.stop_requested.is_set():  # a second signal
            self._force.set()
        self.request_stop(name)

    def request_stop(self, reason: str = "requested") -> Stopping:
        if not self.stop_requested.is_set():
            self.stop_reason = reason
            self.log.info("stop_requested", reason=reason)
            self.stop_requested.set()
        return Stopping()

    async def run_until_stop(self, job: Coroutine[Any, Any, T]) -> T | None:
        """Run `job` until it returns (its result) or a stop is requested (None)."""
        task = asyncio.ensure_future(job)
        stop = asyncio.ensure_future(self.stop_requested.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        return None if task.cancelled() else task.result()

    async def launch(self, specs: list[NodeSpec], *, wait_ready: bool = True) -> None:
        ids = [s.node_id for s in specs]
        dup = sorted({i for i in ids if ids.count(i) > 1 or i in self.nodes})
        if dup:
            raise CoordinatorError(f"duplicate node ids: {dup}")
        for spec in specs:
            spec = replace(spec.with_control(self.control or ""), heartbeat_s=self.heartbeat_s)
            self.supervisor.start(self._with_keys(spec))
        if wait_ready:
            await self.wait_ready(ids)

    def _ensure_keys(self) -> Keyring:
        if self.keyring is None:
            keys = self.run_dir / "keys"
            if not (keys / "server.key_secret").exists():
                generate_keys(keys, force=True)
            self.keyring = Keyring.load(keys)
            self._transport.keys = self.keyring
            self.log.info("curve_keys", directory=str(keys))
        return self.keyring

    def _with_keys(self, spec: NodeSpec) -> NodeSpec:
        """Hand the node our keys: always when we have some, else when it uses tcp."""
        if spec.keys or spec.insecure:
            return spec
        if self.insecure and spec.tcp_addresses():
            return replace(spec, insecure=True)
        if self.keyring is None and not spec.tcp_addresses():
            return spec
        return replace(spec, keys=self._ensure_keys().directory)

    async def wait_ready(self, node_ids: list[str] | None = None,
                         timeout: float | None = None) -> None:  # else NodeNotReady
        await self.supervisor.wait_ready(node_ids, timeout)

    def pid(self, node_id: str) -> int | None:  # while its current process runs
        return self.supervisor.pid(node_id)

    def host(self, node_id: str, default: str) -> str:
        """Where `node_id` binds now (its spec follows a move, `readdress`); `default` for
        a node that binds no tcp endpoint (a local run's ipc://)."""
        record = self.nodes.get(node_id)
        host = record.spec.host() if record is not None else None
        return host or default

    def restart(self, node_id: str, reason: str, pid: int) -> bool:
        """Kill `node_id` and start it again (within restart_limit) as if it had died: for
        a node that cannot go on without a peer that died (a rank of a group). Only the
        process the caller means (`pid`) is killed: a replacement started meanwhile is
        left alone. True if it was killed."""
        return self.supervisor.restart(node_id, reason, pid)

    def readdress(self, node_id: str, moved: dict[str, str]) -> None:
        """`node_id` now binds at new addresses (restarted on another host; `moved`: old
        -> new). Every node's spec follows, so a later (re)start uses them, and each running
        node that connects to an old address is told to reconnect once it is ready."""
        self.log.warning("node_moved", node=node_id, moved=moved)
        for record in self.nodes.values():
            follows = record.spec.connects_to(moved)
            record.spec = record.spec.readdressed(moved)
            if follows and record.spec.node_id != node_id:
                task = self._transport.spawn(self._follow(record.spec.node_id, moved),
                                             name=f"follow-{record.spec.node_id}")
                self._following.add(task)
                task.add_done_callback(self._following.discard)

    async def _follow(self, node_id: str, moved: dict[str, str]) -> None:
        try:
            await self.wait_ready([node_id])
            left = await self.call(node_id, Readdress(moved))
            self.log.info("node_followed_move", node=node_id, left=left)
        except (TimeoutError, CoordinatorError) as e:
            # it died meanwhile: its replacement starts from the re-addressed spec
            self.log.warning("node_not_readdressed", node=node_id, error=str(e))

    async def moves_followed(self) -> None:
        """Once every node told of a move (`readdress`) has reconnected, or failed to."""
        await asyncio.gather(*self._following, return_exceptions=True)

    async def stop(self) -> None:
        """Stop every node: stop command, wait, terminate, wait, kill. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self.supervisor.close()  # a node stopping now is not a death to restart
        for n in self.supervisor.alive():
            shutdown = Stop("coordinator shutdown")
            stop = Message("command", source="coordinator",
                           meta={"name": tag(shutdown), "payload": to_payload(shutdown)})
            with contextlib.suppress(TimeoutError):
                await self._router.send(stop, to=n.spec.peer_id.encode(), timeout=0.1)
        # a stop request grants the grace (the trainer checkpoints); a failed run's may not
        grace = self.stop_timeout if self.stop_requested.is_set() else min(self.stop_timeout, 5.0)
        await self.supervisor.shut_down(grace, self._force)
        self.log.info("coordinator_stopped", reason=self.stop_reason)

    async def call(self, node_id: str, cmd: Command[R], timeout: float = 10.0) -> R:
        """Send the typed command to the node; its typed reply, or CommandError."""
        result = await self.command(node_id, tag(cmd), to_payload(cmd), timeout)
        try:
            return decode_reply(cmd, result)
        except MessageError as e:
            raise CommandError(f"node {node_id!r}: {e}") from None

    async def command(self, node_id: str, kind: str, payload: Any = None,
                      timeout: float = 10.0) -> Any:
        """Invoke the node's `kind` handler with an untyped payload (a tool's or a generic
        node program's command; the typed form is `call`); its reply or CommandError."""
        if node_id not in self.nodes:
            raise CoordinatorError(f"unknown node {node_id!r}; nodes: {sorted(self.nodes)}")
        msg = Message("command", source="coordinator", meta={"name": kind, "payload": payload})
        future = asyncio.get_running_loop().create_future()
        self._pending[msg.id] = future
        try:
            await self._router.send(msg, to=self.nodes[node_id].spec.peer_id.encode(),
                                    timeout=timeout)
            reply = await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise TimeoutError(f"node {node_id!r} did not answer {kind!r} in {timeout}s") from None
        finally:
            self._pending.pop(msg.id, None)
        if not reply.get("ok"):
            raise CommandError(f"node {node_id!r} failed command {kind!r}: {reply.get('error')}")
        return reply.get("result")

    def handle(self, cls: type[Command[R]], handler: Callable[[Any], Any]) -> None:
        self._handlers.add(cls, handler)  # a command of the CLI's (`call_coordinator`)

    def on_event(self, callback: Callable[[NodeEvent], Any]) -> None:
        self._listeners.append(callback)

    def events(self) -> EventStream:
        """NodeEvents from now on: `with coord.events() as stream: async for ev in stream`."""
        return EventStream(self._listeners)

    def _publish(self, event: NodeEvent) -> None:
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:
                self.log.exception("event_listener_failed", event=event.kind)

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        return {"pid": os.getpid(), "control": self.control, "run_dir": str(self.run_dir),
                "uptime_s": round(now - self._started, 2), "stopping": self.stop_requested.is_set(),
                "counters": self.counters, "nodes": self.supervisor.status()}

    # the control socket: heartbeats, handshakes, replies, events, commands
    async def _control_loop(self) -> None:
        while True:
            peer, msg = await self._router.recv_from()
            try:
                await self._on_control(peer, msg)
            except Exception:  # one odd message must not deafen the whole control plane
                self._transport.counters["control.errors"] += 1
                self.log.exception("control_message_failed", kind=msg.kind, source=msg.source)

    async def _on_control(self, peer: bytes, msg: Message) -> None:
        if msg.kind == "command":  # from anyone who may reach the socket (the CLI)
            self._transport.spawn(self._answer(peer, msg), name=f"answer-{msg.id}")
            return
        node = self.nodes.get(msg.source)
        if node is None or not peer.startswith(f"{msg.source}#".encode()):
            self._transport.counters["control.unknown_peer"] += 1
            return
        if peer != node.spec.peer_id.encode():  # an incarnation declared dead: fenced off
            self._transport.counters["control.fenced"] += 1
            self.log.warning("fenced_message", node=msg.source, peer=peer.decode(errors="replace"),
                             kind=msg.kind, incarnation=node.spec.incarnation)
            with contextlib.suppress(TimeoutError):  # it exits at once (runtime/process.py)
                await self._router.send(msg.reply("fenced", source="coordinator"), to=peer,
                                        timeout=0.1)
            return
        node.last_seen = time.monotonic()
        handler = self._from_node.get(msg.kind)
        if handler is not None:  # other kinds from a node: a sign of life only
            await handler(peer, msg, node)

    async def _heartbeat(self, peer: bytes, msg: Message, node: NodeRecord) -> None:
        self._transport.counters["control.heartbeats"] += 1
        if msg.meta.get("ask"):  # the node has not heard from us for a while
            await self._router.send(msg.reply("heartbeat", source="coordinator"), to=peer)

    async def _reply(self, peer: bytes, msg: Message, node: NodeRecord) -> None:
        future = self._pending.get(msg.parent or "")
        if future is not None and not future.done():
            future.set_result(msg.meta)

    async def _ready(self, peer: bytes, msg: Message, node: NodeRecord) -> None:
        node.mark_ready()
        self._publish(NodeEvent(msg.source, tag(NodeReady), msg.meta))

    async def _event(self, peer: bytes, msg: Message, node: NodeRecord) -> None:
        self._publish(NodeEvent(msg.source, str(msg.meta.get("name")), msg.meta.get("payload"),
                                msg.step, msg.weight_version, msg.timestamp))

    async def _goodbye(self, peer: bytes, msg: Message, node: NodeRecord) -> None:
        node.goodbye = msg.meta

    async def _answer(self, peer: bytes, msg: Message) -> None:
        meta = await self._handlers.answer(msg.meta.get("name"), msg.meta.get("payload"))
        await self._router.send(msg.reply("reply", meta=meta, source="coordinator"), to=peer)
