"""Tools in a sandbox: an environment's tool call as a subprocess that cannot hurt the run.

A tool runs in its own process (its own session, so a timeout kills all it started) with a
wall-clock timeout, an address-space limit (RLIMIT_AS), no network, and its output read up
to a cap (stderr joins stdout: a failure shows its last line).
A crash, a hang, a memory blow-up or a flood of output is a failed call: the
`ToolResult` says what happened and the episode reads that as its observation; the
generator never waits past the timeout and never holds more than the cap.

No network, two ways: where this process may create a network namespace (`unshare -rn`:
a user namespace mapping us to root in it, then a network namespace holding only a down
loopback; allowed as root and on kernels that let users create namespaces, probed once),
every tool runs in one, so any program is cut off by the kernel. A Python tool
(`run_python`) also gets an audit hook that refuses to create a socket before its code
runs: that is the fallback where namespaces are not allowed, and it holds either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass

DEFAULT_MEMORY = 1 << 30  # bytes of address space
DEFAULT_OUTPUT = 64 << 10  # bytes of stdout kept; more is a failed call
_NO_SOCKETS = """\
import sys
def _no_network(event, args):
    if event == "socket.__new__":
        raise PermissionError("network access is disabled in the tool sandbox")
sys.addaudithook(_no_network)
del _no_network
"""


@dataclass(frozen=True)
class ToolResult:
    ok: bool
    output: str  # stdout (ok) or what went wrong (not ok)

    def observation(self) -> str:
        """What an episode shows the policy."""
        return self.output if self.ok else f"tool call failed: {self.output}"


@functools.cache
def network_namespace() -> bool:
    """Whether `unshare -rn` works here (probed once per process)."""
    exe = shutil.which("unshare")
    if exe is None:
        return False
    try:
        return subprocess.run([exe, "-rn", "true"], capture_output=True, timeout=10,
                              check=False).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _limits(memory_bytes: int) -> None:
    """In the child before exec: its address space (inherited by all it starts)."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> tuple[bytes, bool]:
    """(up to `cap` bytes, whether there was more)."""
    buf = bytearray()
    while True:
        chunk = await stream.read(1 << 16)
        if not chunk:
            return bytes(buf), False
        buf += chunk
        if len(buf) > cap:
            return bytes(buf[:cap]), True


def _kill(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


async def run_tool(argv: list[str], stdin: str = "", *, timeout_s: float = 10.0,
                   memory_bytes: int = DEFAULT_MEMORY, max_output: int = DEFAULT_OUTPUT,
                   isolate_network: bool = True) -> ToolResult:
    """Run `argv` sandboxed; never raises for what the tool does."""
    if isolate_network and network_namespace():
        argv = ["unshare", "-rn", *argv]
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, start_new_session=True,
            preexec_fn=functools.partial(_limits, memory_bytes))
    except OSError as e:
        return ToolResult(False, f"cannot start {argv[0]!r}: {e}")
    assert proc.stdin is not None and proc.stdout is not None
    failure = ""
    try:
        async with asyncio.timeout(timeout_s):
            proc.stdin.write(stdin.encode())
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                await proc.stdin.drain()
            proc.stdin.close()
            out, over = await _read_capped(proc.stdout, max_output)
            if over:
                failure = f"output over {max_output} bytes"
            else:
                await proc.wait()
    except TimeoutError:
        failure = f"timed out after {timeout_s:g} s"
    finally:
        if proc.returncode is None:
            _kill(proc)
            await proc.wait()
    if failure:
        return ToolResult(False, failure)
    code = proc.returncode
    assert code is not None  # waited for above
    text = out.decode(errors="replace")
    if code != 0:
        what = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
        tail = text.strip().splitlines()[-1:] or [""]
        return ToolResult(False, f"{what}: {tail[0][:300]}".rstrip(": "))
    return ToolResult(True, text)


async def run_python(source: str, stdin: str = "", *, timeout_s: float = 10.0,
                     memory_bytes: int = DEFAULT_MEMORY, max_output: int = DEFAULT_OUTPUT,
                     isolate_network: bool = True) -> ToolResult:
    """Run Python `source` sandboxed (isolated mode: no user site, no PYTHON* variables;
    sockets refused by an audit hook as well)."""
    run = f"exec(compile({source!r}, '<tool>', 'exec'), {{'__name__': '__main__'}})"
    return await run_tool([sys.executable, "-I", "-c", _NO_SOCKETS + run], stdin,
                          timeout_s=timeout_s, memory_bytes=memory_bytes,
                          max_output=max_output, isolate_network=isolate_network)
