"""Where a socket lives on this machine: `ipc://` files only their owner can connect to,
removed again by the process that bound them (libzmq leaves them behind), and free tcp
ports. The transport binds through these; process groups pick their rendezvous port here."""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any

import zmq


def bind_private_ipc(sock: zmq.Socket[Any], path: str) -> tuple[str, int, int]:
    """Bind a unix socket only its owner can connect to (other users cannot join); returns
    the file's (path, device, inode), which closing it removes (libzmq leaves it)."""
    directory = os.path.dirname(path) or "."
    if not os.path.isdir(directory):
        os.makedirs(directory, mode=0o700)
    # libzmq's bind creates the file in this thread with the process umask
    old = os.umask(0o077)
    try:
        sock.bind(f"ipc://{path}")
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    st = os.stat(path)
    return path, st.st_dev, st.st_ino


def remove_socket_file(path: str, dev: int, ino: int) -> None:
    """Remove a socket file this process bound, unless the path is another's now (a
    restarted node bound it again before this one closed)."""
    with contextlib.suppress(OSError):
        st = os.stat(path)
        if (st.st_dev, st.st_ino) == (dev, ino):
            os.unlink(path)


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A tcp port free on `host` now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
