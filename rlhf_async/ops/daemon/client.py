"""Talk to a running daemon over its control socket (one JSON line each way)."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

from rlhf_async.ops.daemon.server import DaemonError, StatePaths


def call_daemon(state_dir: str | Path, request: dict[str, Any], timeout: float = 30.0) -> Any:
    """Send one request; the result, or DaemonError with the daemon's one-line reason."""
    path = StatePaths(Path(state_dir).resolve()).socket
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            raise DaemonError(f"no daemon running for {state_dir} (start one with "
                              f"`rlhf-async serve --state-dir {state_dir}`)") from None
        except PermissionError:
            raise DaemonError(f"{path}: permission denied (the daemon runs as another "
                              "user; use that user, e.g. sudo -u rlhf)") from None
        sock.sendall(json.dumps(request).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except TimeoutError:
        raise DaemonError(f"daemon at {path} did not answer in {timeout}s") from None
    finally:
        sock.close()
    try:
        reply = json.loads(data)
    except json.JSONDecodeError:
        raise DaemonError(f"daemon at {path} closed the connection without an answer") \
            from None
    if not reply.get("ok"):
        raise DaemonError(str(reply.get("error")))
    return reply.get("result")
