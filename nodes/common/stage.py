"""Busy and idle time of one pipeline stage, for utilisation and overlap metrics."""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


class StageClock:
    """Accumulates seconds spent working (`busy`) and waiting for input (`idle`)."""

    def __init__(self) -> None:
        self.busy_s = 0.0
        self.idle_s = 0.0
        self.items = 0

    async def idle(self, waiting: Awaitable[T]) -> T:
        t0 = time.perf_counter()
        try:
            return await waiting
        finally:
            self.idle_s += time.perf_counter() - t0

    async def busy(self, work: Awaitable[T]) -> T:
        t0 = time.perf_counter()
        try:
            return await work
        finally:
            self.busy_s += time.perf_counter() - t0
            self.items += 1

    def snapshot(self) -> dict[str, float]:
        return {"busy_s": self.busy_s, "idle_s": self.idle_s, "items": self.items}
