"""The Tinker API server (`ops/tinker/`) on 127.0.0.1 (a free port) in a thread of the test
process, for tests that drive it with the real `tinker` client."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rlhf_async.ops.tinker.server import ApiServer
from rlhf_async.ops.tinker.service import TinkerService

KEY = "tml-test-key-0123456789"


@contextmanager
def running_api(state_dir: Path, key: str | None = KEY, port: int = 0) -> Iterator[str]:
    """The server's base URL until the block ends (`port` 0: a free one)."""
    loop = asyncio.new_event_loop()
    server = ApiServer(TinkerService(state_dir, device="cpu"), "127.0.0.1", port, key)
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    url = asyncio.run_coroutine_threadsafe(server.start(), loop).result(timeout=60)
    try:
        yield url
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()
