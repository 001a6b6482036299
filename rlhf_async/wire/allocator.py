"""Process memory policy for message buffers: reuse freed memory instead of refaulting it.

Every received tensor frame is a buffer libzmq mallocs (1 MB for a 1 MB tensor) and frees
when the tensor dies. With glibc's defaults, freed memory at the top of a heap is handed
back to the kernel once it passes a trim threshold, and the next message's buffer
page-faults it in again; how often depends on timing, so a 1 MB tcp stream swings
between ~1 and ~70 page faults per message and its throughput between ~4,300 and
~7,300 MB/s on the same box (bench/README.md, Transport). Raising glibc's mmap and trim
thresholds keeps those buffers in the heap: ~1 fault per message, every run.

The cost is that a process keeps up to `TRIM_BYTES` of freed memory at its heap top and
serves blocks under `MMAP_BYTES` from the heap. `MALLOC_MMAP_THRESHOLD_` or
`MALLOC_TRIM_THRESHOLD_` in the environment (glibc's own knobs) win over this, and
`RLHF_ASYNC_MALLOC=default` leaves glibc as it is. Other C libraries: nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

import structlog

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>
MMAP_BYTES = 32 << 20  # glibc's upper bound for the mmap threshold on 64-bit
TRIM_BYTES = 128 << 20

_applied: bool | None = None


def keep_freed_buffers() -> bool:
    """Apply the policy to this process once; True when glibc took it."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    user_set = any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"))
    if (os.environ.get("RLHF_ASYNC_MALLOC") == "default" or user_set
            or platform.libc_ver()[0] != "glibc"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    _applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_BYTES))
    if not _applied:
        structlog.get_logger().debug("mallopt_refused", mmap=MMAP_BYTES, trim=TRIM_BYTES)
    return _applied
