"""Deadlines on a node's long operations, so a node that hangs is a dead node.

Heartbeats come from the node's event loop, so a frozen process (SIGSTOP, a swapped-out
host) or a blocked loop stops them and the coordinator declares the node dead after
`runtime.time_to_dead`. Long work runs off the loop (`asyncio.to_thread`), though: a forward
stuck in a CUDA kernel, or a collective whose peer vanished without closing its sockets,
leaves the loop beating while nothing progresses. The node's `Watchdog` holds a deadline
for each such operation in flight; once one is overdue the heartbeat loop stops beating
(runtime/process.py), and the coordinator kills the node (SIGKILL), restarts it and sends
its work again, as for any death.

    result = await node.watchdog.run("weight_broadcast", 60.0, asyncio.to_thread(recv, plan))
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Overdue:
    what: str
    late_s: float  # past its deadline


class Watchdog:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._open: dict[int, tuple[str, float]] = {}  # token -> (what, deadline)
        self._tokens = itertools.count()

    def begin(self, what: str, deadline_s: float) -> int:
        """An operation `what` starts and must end within `deadline_s`; returns its token."""
        if not deadline_s > 0:
            raise ValueError(f"deadline of {what!r} must be > 0 seconds, got {deadline_s!r}")
        token = next(self._tokens)
        self._open[token] = (what, self.clock() + deadline_s)
        return token

    def end(self, token: int) -> None:
        self._open.pop(token, None)

    async def run(self, what: str, deadline_s: float, work: Awaitable[T]) -> T:
        """Await `work` under a deadline. It is not cancelled when overdue (a thread stuck in
        a kernel cannot be): the node is, by its coordinator."""
        token = self.begin(what, deadline_s)
        try:
            return await work
        finally:
            self.end(token)

    def overdue(self) -> list[Overdue]:
        now = self.clock()
        return [Overdue(what, now - deadline) for what, deadline in self._open.values()
                if now > deadline]
