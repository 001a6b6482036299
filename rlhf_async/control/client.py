"""The control plane's shared pieces: errors, node events, and the client side.

`call_coordinator` is how another process (the CLI's `status` and `stop`) talks to a running
coordinator; it finds the control endpoint (and the CURVE keys, for tcp) in
`RUN_DIR/coordinator.json`.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from rlhf_async.runtime.messages import Msg
from rlhf_async.wire.protocol import Message
from rlhf_async.wire.security import Keyring
from rlhf_async.wire.transport import Endpoint, Transport

COORDINATOR_FILE = "coordinator.json"


class CoordinatorError(RuntimeError):
    """The coordinator cannot do what was asked (unknown node, nothing running, ...)."""


class NodeNotReady(CoordinatorError):
    """A node exited or timed out before its ready handshake."""


class CommandError(CoordinatorError):
    """The node answered a command with an error."""


@dataclass(frozen=True)
class NodeEvent:
    node_id: str
    kind: str  # app kinds from node.emit, plus the coordinator's own (below)
    payload: Any = None
    step: int = 0
    weight_version: int = 0
    timestamp: float = field(default_factory=time.time)


# ---- the coordinator's own events (NodeEvent.kind is the tag) ------------------------------

class NodeReady(Msg, frozen=True, tag="ready"):
    """A node process is up and answers commands (its `main` runs)."""

    pid: int
    role: str
    host: str


class NodeExited(Msg, frozen=True, tag="exited"):
    """A node exited with code 0 (finished, or stopped on request)."""

    rc: int = 0
    reason: str = ""


class NodeRestarted(Msg, frozen=True, tag="node_restarted"):
    restarts: int


class NodeDead(Msg, frozen=True, tag="node_dead"):
    """Heartbeats stopped or the process exited, and whether it is being restarted."""

    reason: str = ""
    will_restart: bool = False
    exit_code: int | None = None  # None: killed for silence
    pid: int | None = None  # the process that died (its replacement has another)


class EventStream:
    """Async iterator over NodeEvents; buffers from creation until `close` (or `with` exit)."""

    def __init__(self, listeners: list[Callable[[NodeEvent], Any]]) -> None:
        self._queue: asyncio.Queue[NodeEvent] = asyncio.Queue()
        self._listeners = listeners
        listeners.append(self._queue.put_nowait)

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> NodeEvent:
        return await self._queue.get()

    async def get(self, timeout: float | None = None) -> NodeEvent:
        return await asyncio.wait_for(self._queue.get(), timeout)

    def close(self) -> None:
        if self._queue.put_nowait in self._listeners:
            self._listeners.remove(self._queue.put_nowait)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_coordinator_file(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / COORDINATOR_FILE
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        raise CoordinatorError(f"no coordinator running in {run_dir} ({path} not found)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise CoordinatorError(f"cannot read {path}: {e}") from None
    if not isinstance(info, dict) or not isinstance(info.get("control"), str):
        raise CoordinatorError(f"{path} has no control endpoint")
    return info


async def call_coordinator(control: str, kind: str, payload: Any = None,
                           timeout: float = 5.0, keys: str | Path | None = None) -> Any:
    """Send a coordinator-level command (e.g. status, stop) from another process; `keys`
    is the CURVE keys directory a tcp control endpoint needs (coordinator.json names it)."""
    identity = f"client-{os.getpid()}-{os.urandom(3).hex()}"
    keyring = Keyring.load(keys) if keys else None
    async with Transport(keys=keyring) as transport:
        chan = transport.channel(Endpoint("dealer", control, identity=identity))
        msg = Message("command", source=identity, meta={"name": kind, "payload": payload})
        await chan.send(msg, timeout=timeout)
        deadline = time.monotonic() + timeout
        while True:
            try:
                reply = await chan.recv(timeout=max(deadline - time.monotonic(), 0.001))
            except TimeoutError:
                raise TimeoutError(f"coordinator at {control} did not answer {kind!r} in "
                                   f"{timeout}s") from None
            if reply.kind == "reply" and reply.parent == msg.id:
                break
    if not reply.meta.get("ok"):
        raise CommandError(f"coordinator failed {kind!r}: {reply.meta.get('error')}")
    return reply.meta.get("result")
