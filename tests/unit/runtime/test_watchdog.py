"""The watchdog's deadlines on a fake clock: an operation past its deadline is overdue
until it ends; a finished one never is."""

import asyncio

import pytest

from rlhf_async.runtime.watchdog import Overdue, Watchdog


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_operation_is_overdue_only_past_its_deadline_and_while_it_runs():
    clock = Clock()
    dog = Watchdog(clock)
    slow, fast = dog.begin("weight_broadcast", 20.0), dog.begin("generate", 5.0)
    clock.now += 5.0
    assert dog.overdue() == []  # at the deadline, not past it
    clock.now += 1.0
    assert dog.overdue() == [Overdue("generate", 1.0)]
    dog.end(fast)
    assert dog.overdue() == []
    clock.now += 30.0
    assert dog.overdue() == [Overdue("weight_broadcast", 16.0)]
    dog.end(slow)
    dog.end(slow)  # ending twice is harmless
    assert dog.overdue() == []
    with pytest.raises(ValueError, match="deadline of 'x' must be > 0"):
        dog.begin("x", 0.0)


def test_run_guards_an_awaitable_and_ends_even_when_it_raises():
    clock = Clock()
    dog = Watchdog(clock)

    async def work(fail: bool) -> int:
        clock.now += 10.0
        assert dog.overdue() == [Overdue("train", 7.0)]
        if fail:
            raise RuntimeError("boom")
        return 7

    assert asyncio.run(dog.run("train", 3.0, work(False))) == 7
    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(dog.run("train", 3.0, work(True)))
    assert dog.overdue() == []
