"""The message-buffer memory policy: applied once per process, and the user's word wins."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from rlhf_async.wire.transport import Transport

PROBE = "from rlhf_async.wire.allocator import keep_freed_buffers as k; print(k(), k())"


def _probe(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("RLHF_ASYNC_MALLOC", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env},
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the policy is glibc's mallopt")
def test_glibc_takes_the_thresholds_once():
    assert _probe() == "True True"


def test_users_own_malloc_settings_win():
    assert _probe(MALLOC_TRIM_THRESHOLD_="1048576") == "False False"
    assert _probe(MALLOC_MMAP_THRESHOLD_="1048576") == "False False"
    assert _probe(RLHF_ASYNC_MALLOC="default") == "False False"


def test_transport_applies_it(monkeypatch):
    calls = []
    monkeypatch.setattr("rlhf_async.wire.transport.keep_freed_buffers", lambda: calls.append(1))
    Transport().ctx.term()
    assert calls == [1]
