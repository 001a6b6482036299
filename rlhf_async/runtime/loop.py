"""One event-loop runner for every process: uvloop when importable.

Called where an event loop already runs in this thread (a Jupyter cell, an async app), the
coroutine runs on its own loop in a worker thread while the caller waits: asyncio cannot
nest loops. An interrupt meanwhile (Jupyter's stop button: KeyboardInterrupt) cancels it,
lets it clean up (nodes stopped, the trainer given its grace) and is raised again."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def in_main_thread() -> bool:
    """Signal handlers can be installed only here (asyncio's and signal.signal alike)."""
    return threading.current_thread() is threading.main_thread()


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # no loop here: the usual case
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            return runner.run(coro)
    return _run_beside(coro)


def _run_beside(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` on a loop of its own in a worker thread; wait for it here."""
    box: dict[str, Any] = {}
    ready = threading.Event()

    def work() -> None:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            box["loop"] = runner.get_loop()
            task = box["task"] = runner.get_loop().create_task(coro)
            ready.set()
            try:
                box["result"] = runner.run(_await(task))
            except BaseException as e:  # handed to the caller's thread
                box["error"] = e

    worker = threading.Thread(target=work, name="rlhf-async-loop", daemon=True)
    worker.start()
    ready.wait()
    try:
        while worker.is_alive():
            worker.join(timeout=0.2)
    except KeyboardInterrupt:
        box["loop"].call_soon_threadsafe(box["task"].cancel)
        worker.join()
        raise
    if "error" in box:
        raise box["error"]
    return box["result"]  # type: ignore[no-any-return]


async def _await(task: asyncio.Task[T]) -> T:
    return await task
