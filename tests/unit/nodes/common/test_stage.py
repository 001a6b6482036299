"""A stage's clock: busy and idle seconds and finished items, counted on a fake clock so the
values are exact (no sleeping, no timing)."""

import asyncio

import pytest

from nodes.common import stage
from nodes.common.stage import StageClock


class FakeTime:
    """perf_counter that only moves when the test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


async def _after(clock: FakeTime, seconds: float, value: object = None,
                 error: Exception | None = None) -> object:
    clock.now += seconds  # the awaited work "took" this long
    if error is not None:
        raise error
    return value


def test_busy_and_idle_add_up_per_kind_and_only_work_counts_as_items(monkeypatch):
    fake = FakeTime()
    monkeypatch.setattr(stage, "time", fake)
    c = StageClock()

    async def run() -> list[object]:
        return [await c.idle(_after(fake, 0.5, "msg")),  # waiting for a chunk
                await c.busy(_after(fake, 2.0, "rollout")),  # generating it
                await c.idle(_after(fake, 0.25)),
                await c.busy(_after(fake, 1.5))]
    assert asyncio.run(run()) == ["msg", "rollout", None, None]
    assert c.snapshot() == {"busy_s": 3.5, "idle_s": 0.75, "items": 2}


def test_time_of_work_that_fails_still_counts(monkeypatch):
    fake = FakeTime()
    monkeypatch.setattr(stage, "time", fake)
    c = StageClock()

    async def run() -> None:
        with pytest.raises(TimeoutError):
            await c.busy(_after(fake, 4.0, error=TimeoutError("deadline")))
        with pytest.raises(TimeoutError):  # a bounded wait that timed out
            await c.idle(_after(fake, 0.5, error=TimeoutError()))
    asyncio.run(run())
    # the failed step held the device for its 4 s, and is counted as an item
    assert c.snapshot() == {"busy_s": 4.0, "idle_s": 0.5, "items": 1}
