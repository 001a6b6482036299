"""A coordinator leaves nothing in its run directory once it is gone: its control socket
(`ctl.sock`) and `coordinator.json` go at a normal end, on an error and on SIGTERM; a
socket file at the same path that another process bound since is left alone."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from rlhf_async.control.coordinator import COORDINATOR_FILE, Coordinator
from rlhf_async.wire.transport import Endpoint, Transport

pytestmark = pytest.mark.timeout(60)


def _left(run_dir) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir())


def test_a_normal_end_removes_the_control_socket(tmp_path):
    async def main() -> None:
        async with Coordinator(tmp_path):
            assert {"ctl.sock", COORDINATOR_FILE} <= set(_left(tmp_path))

    asyncio.run(main())
    assert _left(tmp_path) == []


def test_an_error_removes_the_control_socket(tmp_path):
    async def main() -> None:
        async with Coordinator(tmp_path):
            raise RuntimeError("the job failed")

    with pytest.raises(RuntimeError, match="the job failed"):
        asyncio.run(main())
    assert _left(tmp_path) == []


STOPPED_BY_SIGTERM = textwrap.dedent("""
    import asyncio, sys
    from rlhf_async.control.coordinator import Coordinator
    from rlhf_async.log import configure_logging

    async def main():
        configure_logging("warning")
        async with Coordinator(sys.argv[1]) as c:
            c.install_signal_handlers()
            print("ready", flush=True)
            await c.run_until_stop(asyncio.sleep(60))

    asyncio.run(main())
""")


def test_sigterm_removes_the_control_socket(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", STOPPED_BY_SIGTERM, str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        assert "ctl.sock" in _left(tmp_path)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()
    assert _left(tmp_path) == []


def test_a_socket_file_bound_again_by_another_owner_is_left(ipc_dir):
    """A restarted process may bind the same path before the old one closes: closing the
    old transport must not take the new socket away."""
    path = os.path.join(ipc_dir, "s")

    async def main() -> None:
        old = Transport()
        old.channel(Endpoint("pull", f"ipc://{path}", bind=True))
        os.unlink(path)
        async with Transport() as new:
            new.channel(Endpoint("pull", f"ipc://{path}", bind=True))
            await old.close()
            assert os.path.exists(path)
        assert not os.path.exists(path)

    asyncio.run(main())
