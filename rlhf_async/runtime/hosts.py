"""Hosts file: which machines a multi-host run uses and the devices each lends.

    # name    address[:agent_port]   devices
    gpu-a     10.0.0.1:7100          cuda:0-7
    gpu-b     10.0.0.2               cuda:0-3,cuda:6
    cpu-box   cpu-box.lan            cpu:0,cpu:1

One host per line; `#` starts a comment. The agent port defaults to 7100. A run's global
device index i is the i-th device in file order (gpu-a's cuda:0 is 0, gpu-b's cuda:0 is 8).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

DEFAULT_AGENT_PORT = 7100
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_DEVICE = re.compile(r"^(cpu|cuda):(\d+)(?:-(\d+))?$")


class HostsError(ValueError):
    """A hosts file is invalid; the message lists every problem with its line."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems))


@dataclass(frozen=True)
class Host:
    name: str
    address: str  # DNS name or IP, as the other hosts reach this one
    port: int
    devices: tuple[str, ...]  # e.g. ("cuda:0", "cuda:1")

    @property
    def agent(self) -> str:
        return f"tcp://{self.address}:{self.port}"


def parse_devices(text: str) -> tuple[list[str], list[str]]:
    """`cuda:0-3,cpu:0` -> (devices, problems)."""
    devices, problems = [], []
    for item in text.split(","):
        m = _DEVICE.match(item.strip())
        if m is None:
            problems.append(f"device {item.strip()!r} must look like cuda:N, cuda:A-B or cpu:N")
            continue
        lo, hi = int(m[2]), int(m[3] if m[3] is not None else m[2])
        if hi < lo:
            problems.append(f"device range {item.strip()!r} ends before it starts")
        devices += [f"{m[1]}:{i}" for i in range(lo, hi + 1)]
    return devices, problems


def parse_hosts(text: str, source: str = "hosts file") -> list[Host]:
    hosts: list[Host] = []
    problems: list[str] = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{n}"
        parts = line.split()
        if len(parts) != 3:
            problems.append(f"{where}: expected 'name address[:port] devices', got {line!r}")
            continue
        name, addr, devs = parts
        if not _NAME.match(name):
            problems.append(f"{where}: host name {name!r} must match {_NAME.pattern}")
        address, _, port_text = addr.rpartition(":") if ":" in addr else (addr, "", "")
        port = DEFAULT_AGENT_PORT
        if port_text:
            if not port_text.isdigit() or not 0 < int(port_text) < 65536:
                problems.append(f"{where}: port {port_text!r} must be 1..65535")
            else:
                port = int(port_text)
        devices, bad = parse_devices(devs)
        problems += [f"{where}: {p}" for p in bad]
        if len(set(devices)) != len(devices):
            problems.append(f"{where}: a device is listed twice in {devs!r}")
        if name in {h.name for h in hosts}:
            problems.append(f"{where}: host {name!r} is listed twice")
        hosts.append(Host(name, address, port, tuple(devices)))
    if not hosts and not problems:
        problems.append(f"{source}: no hosts (one 'name address[:port] devices' per line)")
    if problems:
        raise HostsError(problems)
    return hosts


def load_hosts(path: str | Path) -> list[Host]:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise HostsError([f"cannot read hosts file {path}: {e.strerror}"]) from None
    return parse_hosts(text, str(path))


def device_map(hosts: list[Host]) -> list[tuple[Host, str]]:
    """Global device index -> (host, that host's device)."""
    return [(h, d) for h in hosts for d in h.devices]
