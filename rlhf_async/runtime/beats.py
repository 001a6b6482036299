"""Heartbeats through shared memory, for the nodes on the coordinator's own host.

A heartbeat message costs the coordinator a wake-up of its event loop, a receive and a
decode: ~0.3-0.5 ms of CPU on a loaded 2-core box, so 128 nodes beating every 2 s cost it
~1-2% of a core, paid every second of a job. On one host there is a cheaper channel: a
small file every process maps (`BeatBoard`), one 8-byte slot per node incarnation. A node
writes `time.monotonic()` (one clock for every process of a host) into its slot at each
beat; the supervisor reads the slots in its liveness pass, which runs anyway. Slot 0 is the
coordinator's own: it stamps it on every pass, and a node that sees it go stale for
`orphan_timeout_s` knows its coordinator is gone or wedged, without a single answer.

Each start of a node gets a slot of its own (the supervisor hands them out), so a process
declared dead that wakes up later (SIGCONT) writes where nobody reads. Nodes on other
hosts (Ray) keep beating over the control socket.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

SLOT_BYTES = 8  # one float64: an aligned 8-byte store, so a reader never sees half of one
COORDINATOR = 0  # the coordinator's own slot


class BeatBoard:
    """`slots` float64 slots in the file at `path`, mapped shared."""

    def __init__(self, path: Path | str, fd: int) -> None:
        self.path = str(path)
        size = os.fstat(fd).st_size
        self._map = mmap.mmap(fd, size)
        os.close(fd)
        self._view = memoryview(self._map).cast("d")
        self.slots = len(self._view)

    @classmethod
    def create(cls, path: Path | str, slots: int) -> BeatBoard:
        """A new board of `slots` zeroed slots (0600: only this user's processes write)."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(fd, slots * SLOT_BYTES)
        return cls(path, fd)

    @classmethod
    def open(cls, path: Path | str) -> BeatBoard:
        return cls(path, os.open(path, os.O_RDWR))

    def stamp(self, slot: int, when: float) -> None:
        self._view[slot] = when

    def read(self, slot: int) -> float:
        """The last stamp of `slot` (0.0 before the first)."""
        return float(self._view[slot])

    def close(self) -> None:
        self._view.release()
        self._map.close()
