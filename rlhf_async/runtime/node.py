"""Node: what a node program sees. Sockets, stop/pause state, commands, events, logs, counters."""

from __future__ import annotations

import asyncio
import inspect
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, TypeVar

import psutil
import structlog

from rlhf_async.runtime.messages import (
    Command,
    Handlers,
    Msg,
    Pause,
    Paused,
    Peers,
    Readdress,
    Resume,
    Status,
    Stop,
    Stopping,
    tag,
    to_payload,
)
from rlhf_async.runtime.spec import NodeSpec
from rlhf_async.runtime.watchdog import Watchdog
from rlhf_async.wire.protocol import Message
from rlhf_async.wire.transport import Channel, Transport

# An untyped command handler (`on_command`) gets the payload, returns a msgpack-able reply.
Handler = Callable[[Any], Any | Awaitable[Any]]
R = TypeVar("R")
T = TypeVar("T")


class Node:
    """Handed to `async def main(node)`; built by the runtime, one per process.

    Heartbeats and command handlers run on the same event loop as `main`, so long
    synchronous work (a generation step, an optimizer step) belongs in
    `await asyncio.to_thread(fn, ...)`; torch releases the GIL while it computes. A loop
    blocked longer than the coordinator's `time_to_dead` gets the node declared dead.
    """

    def __init__(self, spec: NodeSpec, transport: Transport, control: Channel) -> None:
        self.spec = spec
        self.transport = transport
        self.counters: Counter[str] = transport.counters
        self.log = structlog.get_logger().bind(role=spec.role, node_id=spec.node_id)
        self.info: dict[str, Any] = {}  # free-form app state reported by the status command
        self.watchdog = Watchdog()  # deadlines of long operations; overdue: no heartbeats
        self._control = control
        self._stop = asyncio.Event()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self.stop_reason = ""
        self._started = time.monotonic()
        self._channels = {name: transport.channel(ep) for name, ep in spec.endpoints.items()}
        self._commands = Handlers(self.log)  # typed: `handle`
        self._untyped: dict[str, Handler] = {}  # `on_command`
        self.handle(Pause, lambda _: self._set_paused(True))
        self.handle(Resume, lambda _: self._set_paused(False))
        self.handle(Stop, lambda cmd: self.request_stop(f"command: {cmd.reason}"))
        self.handle(Status, lambda _: self.status())
        self.handle(Readdress, lambda cmd: self._readdress(cmd.moved))
        self.handle(Peers, lambda cmd: self._repeer(cmd.channel, cmd.addresses))

    @property
    def node_id(self) -> str:
        return self.spec.node_id

    @property
    def params(self) -> dict[str, Any]:
        return self.spec.params

    def socket(self, name: str) -> Channel:
        """The channel of the spec's data endpoint `name` (opened before `main` starts)."""
        if name not in self._channels:
            raise KeyError(f"node {self.node_id} has no endpoint {name!r}; "
                           f"spec endpoints: {sorted(self._channels)}")
        return self._channels[name]

    # stop / pause
    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    async def wait_stop(self) -> None:
        await self._stop.wait()

    async def unless_stopped(self, waiting: Awaitable[T]) -> T | None:
        """`waiting` (a loop's wait for its next input), or None once a stop is requested
        first, `waiting` then cancelled: an idle node ends at a stop at once, not after its
        stop grace (a second per node at every run's end)."""
        work = asyncio.ensure_future(waiting)
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            work.cancel()
            raise
        finally:
            stop.cancel()
        if work.done():  # the input came first (or with the stop): it is handled
            return work.result()
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        return None

    def request_stop(self, reason: str = "requested") -> Stopping:
        if not self._stop.is_set():
            self.stop_reason = reason
            self.log.info("stopping", reason=reason)
            self._stop.set()
            self._resumed.set()  # a paused loop must wake up to see the stop
        return Stopping()

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    async def wait_resumed(self) -> None:
        """Returns at once unless paused; call it once per iteration of a node's main loop."""
        await self._resumed.wait()

    def _set_paused(self, paused: bool) -> Paused:
        if paused and not self.stopping:
            self._resumed.clear()
        else:
            self._resumed.set()
        self.log.info("paused" if self.paused else "resumed")
        return Paused(self.paused)

    def _readdress(self, moved: dict[str, str]) -> dict[str, list[str]]:
        """Peers bound at the old addresses (keys of `moved`) now listen at the new ones
        (a node restarted on another host): every data channel connecting to one follows.
        Replies with what each channel left."""
        left = {name: old for name, chan in self._channels.items()
                if (old := chan.readdress(moved))}
        self.spec = self.spec.readdressed(moved)  # what status and later reads see
        self.log.info("endpoints_readdressed", moved=moved, channels=sorted(left))
        return left

    def _repeer(self, name: str, addresses: list[str]) -> list[str]:
        """Channel `name` now connects to exactly `addresses` (a peer added or retired)."""
        if name not in self._channels:
            raise ValueError(f"no data channel {name!r}; this node has {sorted(self._channels)}")
        left = self._channels[name].repeer(addresses)
        eps = dict(self.spec.endpoints)
        eps[name] = self._channels[name].endpoint
        self.spec = replace(self.spec, endpoints=eps)
        self.log.info("peers_changed", channel=name, peers=addresses, left=left)
        return left

    # commands and events
    def handle(self, cls: type[Command[R]], handler: Callable[[Any], R | Awaitable[R]]
               ) -> None:
        """Answer `coordinator.call(node_id, cls(...))` with `handler(command) -> R`; the
        payload is validated into `cls` first (a mismatch is answered as an error)."""
        self._commands.add(cls, handler)

    def on_command(self, kind: str, handler: Handler) -> None:
        """An untyped command (a generic node program's): `handler(payload) -> reply` for
        `coordinator.command(node_id, kind, payload)`."""
        if kind in self._commands.names:
            raise ValueError(f"command {kind!r} is built in ({', '.join(self._commands.names)})")
        self._untyped[kind] = handler

    async def send_event(self, event: Msg, *, step: int = 0, weight_version: int = 0) -> None:
        """Send a typed event to the coordinator (see `emit`)."""
        await self.emit(tag(event), to_payload(event), step=step, weight_version=weight_version)

    async def emit(self, kind: str, payload: Any = None, *, step: int = 0,
                   weight_version: int = 0) -> None:
        """Send an app-level event (msgpack-able payload) to the coordinator.

        Raises TimeoutError when the coordinator has not drained its control queue for
        `orphan_timeout_s` (it is gone or wedged)."""
        msg = Message("event", meta={"name": kind, "payload": payload}, source=self.node_id,
                      step=step, weight_version=weight_version)
        try:
            await self._control.send(msg, timeout=self.spec.orphan_timeout_s)
        except TimeoutError:
            raise TimeoutError(f"node {self.node_id}: event {kind!r} to the coordinator at "
                               f"{self.spec.control} not accepted within "
                               f"{self.spec.orphan_timeout_s}s") from None

    async def handle_command(self, msg: Message) -> None:
        name, payload = msg.meta.get("name"), msg.meta.get("payload")
        if isinstance(name, str) and name in self._untyped:
            meta = await self._answer_untyped(name, self._untyped[name], payload)
        elif isinstance(name, str) and name in self._commands.names:
            meta = await self._commands.answer(name, payload)
        else:
            meta = {"ok": False, "error": f"unknown command {name!r}; known: "
                                          f"{sorted([*self._commands.names, *self._untyped])}"}
        reply = msg.reply("reply", meta=meta)
        reply.source = self.node_id
        try:
            await self._control.send(reply, timeout=self.spec.orphan_timeout_s)
        except TypeError as e:  # handler returned something msgpack cannot encode
            reply.meta = {"ok": False, "error": f"reply of {name!r} is not msgpack-able: {e}"}
            await self._control.send(reply, timeout=self.spec.orphan_timeout_s)

    async def _answer_untyped(self, name: str, handler: Handler, payload: Any
                              ) -> dict[str, Any]:
        try:
            result = handler(payload)
            if inspect.isawaitable(result):
                result = await result
            return {"ok": True, "result": result}
        except Exception as e:  # a failing handler must not kill the node
            self.log.exception("command_failed", command=name)
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}

    def status(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id, "role": self.spec.role, "pid": os.getpid(),
            "paused": self.paused, "stopping": self.stopping,
            "uptime_s": round(time.monotonic() - self._started, 3),
            "rss_bytes": psutil.Process().memory_info().rss,
            "counters": dict(self.counters), "info": self.info,
        }
