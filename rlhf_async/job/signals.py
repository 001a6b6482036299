"""`on_stop_signals(handler)`: SIGTERM and SIGINT go to `handler` in a block (main thread
only: elsewhere Python delivers no signals, and the block runs unchanged)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def on_stop_signals(handler: Any, restore: bool = True) -> Iterator[None]:
    """The stop signals to `handler` in this block; the old handlers back after it unless
    `restore` is False (the caller's process exits right after)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items() if restore else ():
            signal.signal(s, h)
