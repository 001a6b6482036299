"""ZeroMQ transport: typed endpoints, validated channels, one owner for sockets and tasks.

Data queues are PUSH/PULL with high-water marks, so a full downstream queue makes the
upstream `send` wait (backpressure) instead of growing memory; control is ROUTER/DEALER.
Closing drops unsent messages (linger=0): callers that must deliver keep running until
their peer acknowledged (the coordinator's stop does that for pipelines); it removes the
`ipc://` socket files it bound (libzmq leaves them behind).

Security: a bound `ipc://` socket file is 0600 (created under umask 077, so never wider,
not even briefly). With a `Keyring`, every tcp socket uses CURVE and a bound one admits
only authorised client keys (see `rlhf_async.wire.security`). Without one, plaintext tcp is
allowed only on loopback addresses; anything else needs `insecure=True`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Coroutine, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Self

import structlog
import zmq
import zmq.asyncio

from rlhf_async.wire.allocator import keep_freed_buffers
from rlhf_async.wire.local import bind_private_ipc, remove_socket_file
from rlhf_async.wire.protocol import (
    DEFAULT_MAX_BYTES,
    MAX_HEADER_BYTES,
    Message,
    ProtocolError,
    decode,
    encode,
)
from rlhf_async.wire.security import (
    HANDSHAKE_FAILED_EVENTS,
    Keyring,
    SecurityError,
    ZapHandler,
    count_handshake_failures,
    is_loopback,
)

SOCKET_TYPES = {"push": zmq.PUSH, "pull": zmq.PULL, "router": zmq.ROUTER, "dealer": zmq.DEALER}
_NOBLOCK = int(zmq.NOBLOCK)  # a plain int: enum flag arithmetic costs on every call
IPC_PATH_MAX = 100  # sockaddr_un holds ~107 bytes; keep a margin


class EndpointError(ValueError):
    """An endpoint that cannot be used: bad type, address, HWM or bind/connect failure."""


@dataclass(frozen=True)
class Endpoint:
    """One socket: its type, address (ipc:// or tcp://), whether it binds, and its HWM."""

    type: str
    address: str
    bind: bool = False
    hwm: int = 16
    identity: str | None = None  # DEALER routing id, so a ROUTER can address this peer
    # further addresses a connecting socket also connects to: a PUSH spreads its messages
    # over all of them (round-robin), a PULL fair-queues from all of them
    also: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        problems = []
        if self.type not in SOCKET_TYPES:
            problems.append(f"type {self.type!r} not one of {sorted(SOCKET_TYPES)}")
        if not isinstance(self.also, tuple):
            problems.append(f"also {self.also!r} must be a list of addresses")
        elif self.also and self.bind:
            problems.append("also: only a connecting endpoint can name further addresses")
        for address in (self.address, *(self.also if isinstance(self.also, tuple) else ())):
            problems += _address_problems(address)
        if type(self.hwm) is not int or self.hwm < 1:
            problems.append(f"hwm {self.hwm!r} must be an int >= 1")
        if type(self.bind) is not bool:
            problems.append(f"bind {self.bind!r} must be true or false")
        if problems:
            raise EndpointError("endpoint: " + "; ".join(problems))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Endpoint:
        unknown = set(d) - {"type", "address", "bind", "hwm", "identity", "also"}
        if unknown or "type" not in d or "address" not in d:
            raise EndpointError(f"endpoint {d!r}: needs type and address, accepts "
                                "bind, hwm, identity, also")
        if isinstance(d.get("also"), list):
            d = {**d, "also": tuple(d["also"])}
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _address_problems(address: Any) -> list[str]:
    if not isinstance(address, str) or not address.startswith(("ipc://", "tcp://")):
        return [f"address {address!r} must start with ipc:// or tcp://"]
    if address.startswith("ipc://") and len(address) - 6 > IPC_PATH_MAX:
        return [(f"ipc path is {len(address) - 6} chars, limit {IPC_PATH_MAX}; "
                 "use a shorter directory")]
    return []


def ipc_address(directory: str, name: str) -> str:
    """`ipc://DIR/NAME`, or an EndpointError when the path is too long for a unix socket."""
    return Endpoint("pull", f"ipc://{os.path.join(directory, name)}").address


class _RateLimitedLog:
    """At most one warning per `interval` seconds; the rest are counted as suppressed."""

    def __init__(self, log: Any, interval: float = 5.0) -> None:
        self.log, self.interval, self.last, self.suppressed = log, interval, -1e9, 0

    def warning(self, event: str, **kw: Any) -> None:
        now = time.monotonic()
        if now - self.last < self.interval:
            self.suppressed += 1
            return
        self.log.warning(event, suppressed=self.suppressed, **kw)
        self.last, self.suppressed = now, 0


class Channel:
    """A validated socket: send/recv `Message`s; malformed input is counted and skipped."""

    def __init__(self, sock: zmq.asyncio.Socket, endpoint: Endpoint, transport: Transport):
        self.sock, self.endpoint, self._t = sock, endpoint, transport
        # Non-blocking calls on a plain (shadow) socket skip zmq.asyncio's future machinery
        # when the queue is ready, which is most of the time under load; the async socket
        # is only polled when we must wait.
        self._sync: zmq.Socket[Any] = zmq.Socket.shadow(sock.underlying)
        self._routed = endpoint.type == "router"
        self._fast_ops = 0
        self.linger_ms = 0  # how long close() may still flush queued messages

    def _wake_waiters(self) -> None:
        # The zmq fd is edge-triggered: an operation on the shadow socket can consume the
        # edge that a task awaiting this socket (a recv while we send) still needs, and that
        # task would sleep forever. zmq.asyncio's own fast path re-checks in the same way.
        sock: Any = self.sock
        if sock._recv_futures or sock._send_futures:
            sock._schedule_remaining_events()

    async def _yield_sometimes(self) -> None:
        # A ready socket never suspends the caller; yield now and then so heartbeats and
        # command handlers on the same loop keep running.
        self._fast_ops += 1
        if self._fast_ops % 32 == 0:
            await asyncio.sleep(0)

    async def _wait(self, event: int, deadline: float | None, what: str) -> None:
        timeout_ms = None if deadline is None else max(deadline - time.monotonic(), 0) * 1000
        if not await self.sock.poll(timeout_ms, event):  # type: ignore[call-arg]  # stub lacks flags
            raise TimeoutError(f"{what} on {self.endpoint.address} timed out")

    async def send(self, msg: Message, *, to: bytes | None = None,
                   timeout: float | None = None) -> None:
        """Send `msg` (to peer `to` on a ROUTER); waits while the peer queue is at its HWM."""
        frames: list[Any] = encode(msg)
        if self._routed:
            if to is None:
                raise ValueError("a router channel needs `to` (the peer identity)")
            frames.insert(0, to)
        try:
            self._sync.send_multipart(frames, zmq.NOBLOCK, copy=False)
            self._wake_waiters()
            return await self._yield_sometimes()
        except zmq.Again:
            pass
        if timeout is not None:
            await self._wait(zmq.POLLOUT, time.monotonic() + timeout, f"send ({timeout}s)")
        await self.sock.send_multipart(frames, copy=False)

    async def recv(self, timeout: float | None = None) -> Message:
        return (await self.recv_from(timeout))[1]

    async def recv_from(self, timeout: float | None = None) -> tuple[bytes, Message]:
        """Next valid message and its sender identity (b"" unless this is a ROUTER)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                frames = self._recv_nowait()
                self._wake_waiters()
                await self._yield_sometimes()
            except zmq.Again:
                if deadline is not None:
                    await self._wait(zmq.POLLIN, deadline, f"receive ({timeout}s)")
                frames = await self.sock.recv_multipart(copy=False)
            peer = b""
            if self._routed:
                peer, frames = frames[0].bytes, frames[1:]
            try:
                return peer, decode(frames, self._t.max_bytes)
            except ProtocolError as e:
                self._t.reject(e, self.endpoint.address)

    def _recv_nowait(self) -> list[zmq.Frame]:
        """The next message's frames, or zmq.Again. Reads `Frame.more` where
        `recv_multipart` asks the socket for RCVMORE after every frame (~2 us a message);
        libzmq delivers a message whole, so once its first frame is here all are."""
        frame = self._sync.recv(_NOBLOCK, copy=False)
        frames = [frame]
        while frame.more:
            frame = self._sync.recv(_NOBLOCK, copy=False)
            frames.append(frame)
        return frames

    def readdress(self, moved: Mapping[str, str]) -> list[str]:
        """Follow peers that moved (old address -> new): a connecting channel disconnects
        from each old address it uses and connects to the new one. What was queued for the
        old peer is dropped with its pipe (that peer is gone; the senders' bookkeeping sends
        it again), so nothing more waits for a host that will not come back. Returns the
        old addresses it left."""
        ep = self.endpoint
        old = [] if ep.bind else [a for a in (ep.address, *ep.also) if a in moved]
        if not old:
            return []
        for address in old:
            with contextlib.suppress(zmq.ZMQError):  # never connected there: nothing to end
                self.sock.disconnect(address)
            self.sock.connect(moved[address])
        self.endpoint = replace(ep, address=moved.get(ep.address, ep.address),
                                also=tuple(moved.get(a, a) for a in ep.also))
        return old

    def repeer(self, addresses: Sequence[str]) -> list[str]:
        """A connecting channel's peers become `addresses` (a job scaled: a peer added or
        retired): it connects to the new ones and disconnects from those left out, whose
        queued messages are dropped with their pipe (the senders' bookkeeping sends them
        again). Returns the addresses it left."""
        ep = self.endpoint
        if ep.bind or not addresses:
            raise ValueError(f"{ep.address}: only a connecting channel takes a list of "
                             "peers, and it needs at least one")
        now = (ep.address, *ep.also)
        left = [a for a in now if a not in addresses]
        for address in left:
            with contextlib.suppress(zmq.ZMQError):
                self.sock.disconnect(address)
        for address in addresses:
            if address not in now:
                self.sock.connect(address)
        self.endpoint = replace(ep, address=addresses[0], also=tuple(addresses[1:]))
        return left

    def __aiter__(self) -> AsyncIterator[Message]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[Message]:
        while True:
            yield await self.recv()


class Transport:
    """Owns a zmq context, its channels and background tasks; `close` always cleans up."""

    def __init__(self, *, counters: Counter[str] | None = None,
                 max_bytes: int = DEFAULT_MAX_BYTES, log: Any = None,
                 keys: Keyring | None = None, insecure: bool = False) -> None:
        keep_freed_buffers()  # received frames reuse heap memory (see rlhf_async.wire.allocator)
        self.ctx = zmq.asyncio.Context()
        self.keys, self.insecure = keys, insecure
        self._zap: ZapHandler | None = None
        self.counters: Counter[str] = counters if counters is not None else Counter()
        self.max_bytes = max_bytes
        self.log = log or structlog.get_logger()
        self._reject_log = _RateLimitedLog(self.log)
        self._auth_log = _RateLimitedLog(self.log)  # a refused peer retries every ~100 ms
        self._channels: list[Channel] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._socket_files: list[tuple[str, int, int]] = []  # bound ipc://, removed on close
        self._closed = False

    def channel(self, endpoint: Endpoint) -> Channel:
        sock = self.ctx.socket(SOCKET_TYPES[endpoint.type])
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, endpoint.hwm)
        sock.setsockopt(zmq.RCVHWM, endpoint.hwm)
        # Per-frame cap enforced by libzmq itself: a peer sending more is disconnected.
        sock.setsockopt(zmq.MAXMSGSIZE, max(self.max_bytes, MAX_HEADER_BYTES))
        if endpoint.identity:
            sock.setsockopt(zmq.IDENTITY, endpoint.identity.encode())
        try:
            curve = self._secure(sock, endpoint)
            if endpoint.bind and endpoint.address.startswith("ipc://"):
                self._socket_files.append(bind_private_ipc(sock, endpoint.address[6:]))
            elif endpoint.bind:
                sock.bind(endpoint.address)
            else:
                for address in (endpoint.address, *endpoint.also):
                    sock.connect(address)
        except zmq.ZMQError as e:
            sock.close(0)
            verb = "bind" if endpoint.bind else "connect"
            raise EndpointError(f"cannot {verb} {endpoint.address}: {e}") from None
        except BaseException:
            sock.close(0)
            raise
        if curve and endpoint.bind:
            monitor = sock.get_monitor_socket(HANDSHAKE_FAILED_EVENTS)
            self.spawn(count_handshake_failures(monitor, endpoint.address, self.counters,
                                                self._auth_log), name=f"auth-{endpoint.address}")
        chan = Channel(sock, endpoint, self)
        self._channels.append(chan)
        return chan

    def _secure(self, sock: zmq.asyncio.Socket, endpoint: Endpoint) -> bool:
        """Apply CURVE to a tcp endpoint (True), or check plaintext is allowed (False)."""
        tcp = [a for a in (endpoint.address, *endpoint.also) if a.startswith("tcp://")]
        if not tcp:
            return False
        if self.keys is None:
            remote = [a for a in tcp if not is_loopback(a)]
            if remote and not self.insecure:
                raise SecurityError(
                    f"{', '.join(remote)}: tcp beyond loopback needs CURVE keys (make them "
                    "with `rlhf-async keys DIR`; pass Transport(keys=Keyring.load(DIR)) or "
                    "set NodeSpec.keys) or insecure=True to send plaintext")
            return False
        if endpoint.bind and self._zap is None:
            self._zap = ZapHandler(self.ctx, self.keys.authorized, self.counters,
                                   self._auth_log)
            self.spawn(self._zap.serve(), name="zap")
        self.keys.apply(sock, endpoint.bind, endpoint.address)
        return True

    def reject(self, error: ProtocolError, where: str) -> None:
        self.counters["rejected"] += 1
        self.counters[f"rejected.{error.reason}"] += 1
        self._reject_log.warning("message_rejected", reason=error.reason, error=str(error),
                                 endpoint=where, total=self.counters["rejected"])

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run `coro` as a background task owned (and cancelled on close) by this transport."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.log.error("background_task_failed", task=task.get_name(),
                           exc_info=task.exception())

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for chan in self._channels:
            chan.sock.close(linger=chan.linger_ms)
        if self._zap is not None:
            self._zap.close()
        self.ctx.term()
        for path, dev, ino in self._socket_files:
            remove_socket_file(path, dev, ino)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
