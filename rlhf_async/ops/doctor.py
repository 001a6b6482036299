"""`rlhf-async doctor HOSTS`: check every host of a multi-host run before starting it.

For each host, in order, stopping at its first failure: the address resolves, the agent
port accepts tcp, the agent answers over CURVE (keys match), its version is ours, and the
devices the hosts file lends exist there. One line per problem; exit 1 when any.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from rlhf_async import __version__
from rlhf_async.runtime.hosts import Host
from rlhf_async.runtime.remote import AgentLink, AgentUnavailable
from rlhf_async.wire.security import Keyring


@dataclass(frozen=True)
class Finding:
    host: str
    ok: bool
    text: str

    def line(self) -> str:
        return f"{'ok     ' if self.ok else 'PROBLEM'} {self.host}: {self.text}"


def _tcp_problem(host: Host, timeout: float) -> str | None:
    where = f"{host.address}:{host.port}"
    try:
        infos = socket.getaddrinfo(host.address, host.port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return f"address {host.address!r} does not resolve (missing host? check DNS or " \
               "/etc/hosts)"
    address = (str(infos[0][4][0]), int(infos[0][4][1]))
    try:
        with socket.create_connection(address, timeout=timeout):
            return None
    except ConnectionRefusedError:
        return f"port {host.port} closed at {where} (connection refused): is " \
               f"`rlhf-async agent --bind tcp://{where}` running there?"
    except TimeoutError:
        return f"{where} unreachable (no answer in {timeout}s: host down or firewalled)"
    except OSError as e:
        return f"{where} unreachable ({e.strerror})"


def check_host(host: Host, keyring: Keyring | None, ctx: zmq.Context[Any],
               timeout: float = 3.0, insecure: bool = False) -> Finding:
    problem = _tcp_problem(host, timeout)
    if problem is not None:
        return Finding(host.name, False, problem)
    link = AgentLink(host, keyring, ctx, insecure)
    try:
        hello = link.request("hello", timeout=timeout)
    except AgentUnavailable:
        return Finding(host.name, False, f"port {host.port} is open but the agent did not "
                       f"answer over CURVE in {timeout}s: keys do not match (copy the same "
                       "`rlhf-async keys` directory to every host) or it is not an agent")
    finally:
        link.close()
    if hello.get("version") != __version__:
        return Finding(host.name, False, f"agent runs rlhf-async {hello.get('version')}, "
                       f"this machine {__version__} (install the same version everywhere)")
    missing = [d for d in host.devices if d not in hello.get("devices", [])]
    if missing:
        return Finding(host.name, False, f"devices {', '.join(missing)} not present there "
                       f"(agent sees {', '.join(hello.get('devices', [])) or 'none'})")
    return Finding(host.name, True, f"agent {hello.get('host')} pid {hello.get('pid')}, "
                   f"rlhf-async {__version__}, devices {', '.join(host.devices)}")


def run_doctor(hosts: list[Host], keys: str | Path | None, timeout: float = 3.0,
               insecure: bool = False) -> list[Finding]:
    keyring = Keyring.load(keys) if keys else None
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        return [check_host(h, keyring, ctx, timeout, insecure) for h in hosts]
    finally:
        ctx.term()
