"""`on_stop_signals(handler)`: SIGTERM and SIGINT go to `handler` in a block (main thread
only: elsewhere Python delivers no signals, and the block runs unchanged)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def on_stop_signals(handler: Any, restore: bool = True, again_s: float = 0.0) -> Iterator[None]:
    """The stop signals to `handler` in this block; the old handlers back after it unless
    `restore` is False (the caller's process exits right after). With `again_s`, a handler
    that raises is called again every `again_s` seconds after a stop signal until the block
    ends: library code may swallow the first raise (torch's `record_function` imports a
    module inside an `except Exception` on its first use), and the stop must still land."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    asked: list[Any] = []  # once a stop came: its signal, and SIGALRM's handler and timer

    def stop(signum: int, frame: Any) -> None:
        if again_s > 0 and not asked:
            alarm = signal.signal(signal.SIGALRM, lambda _s, f: handler(signum, f))
            asked.extend([signum, alarm, signal.setitimer(signal.ITIMER_REAL, again_s, again_s)])
        handler(signum, frame)

    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        if asked:  # SIGALRM as it was (a test runner's timeout, say)
            signal.setitimer(signal.ITIMER_REAL, 0)  # first: no raise again in here
            signal.signal(signal.SIGALRM, asked[1])
            signal.setitimer(signal.ITIMER_REAL, *asked[2])
        for s, h in old.items() if restore else ():
            signal.signal(s, h)
