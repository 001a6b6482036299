"""NodeSpec: everything a node process needs, as plain data that round-trips through JSON."""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from rlhf_async.wire.protocol import DEFAULT_MAX_BYTES
from rlhf_async.wire.transport import Endpoint, EndpointError

_ENTRY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_NODE_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class SpecError(ValueError):
    """A node spec is invalid; the message lists every problem."""


@dataclass(frozen=True)
class NodeSpec:
    role: str
    node_id: str
    entry: str  # "package.module:async_function", called as `await fn(node)`
    endpoints: dict[str, Endpoint] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"  # device slot, e.g. "cpu:0" or "cuda:1"; interpreted by node programs
    env: dict[str, str] = field(default_factory=dict)
    num_threads: int = 1  # torch.set_num_threads in the node process
    flush_denormal: bool = True  # subnormal floats as zero in the node process (runtime/cpu.py)
    control: str = ""  # coordinator control endpoint; the coordinator fills it in
    heartbeat_s: float = 0.5  # between heartbeats; a coordinator launching the node sets its own
    orphan_timeout_s: float = 10.0  # exit when the coordinator is silent this long
    stop_grace_s: float = 1.0  # after a stop request, main gets this long before cancel
    max_message_bytes: int = DEFAULT_MAX_BYTES
    log_level: str = "info"
    # CURVE keys directory on the node's host (`rlhf-async keys DIR`); every tcp endpoint of
    # the node then authenticates and encrypts. The coordinator fills it in when empty.
    keys: str = ""
    insecure: bool = False  # allow plaintext tcp beyond loopback when there are no keys
    # which start of the node this process is (0 first, +1 a restart; the supervisor sets
    # it): a process declared dead is fenced off by it (`peer_id`)
    incarnation: int = 0
    # on the coordinator's host, the shared heartbeat board and this incarnation's slot in
    # it (runtime/beats.py; the supervisor sets both): beats go there, not over the socket
    beats: str = ""
    beat_slot: int = 0

    def __post_init__(self) -> None:
        problems = []
        for name in ("role", "node_id", "entry", "device", "control", "log_level", "keys",
                     "beats"):
            if not isinstance(getattr(self, name), str):
                problems.append(f"{name} must be a string")
        if isinstance(self.node_id, str) and not _NODE_ID.match(self.node_id):
            problems.append(f"node_id {self.node_id!r} must match {_NODE_ID.pattern}")
        if isinstance(self.entry, str) and not _ENTRY.match(self.entry):
            problems.append(f"entry {self.entry!r} must look like 'package.module:function'")
        if type(self.num_threads) is not int or self.num_threads < 1:
            problems.append(f"num_threads {self.num_threads!r} must be an int >= 1")
        for name in ("heartbeat_s", "orphan_timeout_s", "stop_grace_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                problems.append(f"{name} {value!r} must be a number > 0")
        if not isinstance(self.params, dict):
            problems.append("params must be a mapping")
        if not isinstance(self.env, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()):
            problems.append("env must map strings to strings")
        if not isinstance(self.endpoints, dict) or not all(
                isinstance(v, Endpoint) for v in self.endpoints.values()):
            problems.append("endpoints must map names to Endpoint")
        if type(self.incarnation) is not int or self.incarnation < 0:
            problems.append(f"incarnation {self.incarnation!r} must be an int >= 0")
        if type(self.beat_slot) is not int or self.beat_slot < 0:
            problems.append(f"beat_slot {self.beat_slot!r} must be an int >= 0")
        if type(self.flush_denormal) is not bool:
            problems.append(f"flush_denormal {self.flush_denormal!r} must be true or false")
        if type(self.insecure) is not bool:
            problems.append(f"insecure {self.insecure!r} must be true or false")
        if problems:
            raise SpecError(f"node spec {self.node_id!r}: " + "; ".join(problems))

    @property
    def peer_id(self) -> str:
        """The node's identity on the coordinator's control socket: its id and incarnation,
        so what an earlier incarnation sends never passes for the live one's."""
        return f"{self.node_id}#{self.incarnation}"

    def tcp_addresses(self) -> list[str]:
        """Every tcp:// address this node binds or connects to, control included."""
        addresses = [self.control] if isinstance(self.control, str) else []
        if isinstance(self.endpoints, dict):
            for ep in self.endpoints.values():
                if isinstance(ep, Endpoint):
                    addresses += [ep.address, *ep.also]
        return [a for a in addresses if a.startswith("tcp://")]

    def with_control(self, address: str) -> NodeSpec:
        return replace(self, control=address)

    def readdressed(self, moved: Mapping[str, str]) -> NodeSpec:
        """This spec with every endpoint address (bound or connected, `also` included) that
        is a key of `moved` replaced by its value: the node's peers moved there."""
        eps = {name: replace(ep, address=moved.get(ep.address, ep.address),
                             also=tuple(moved.get(a, a) for a in ep.also))
               for name, ep in self.endpoints.items()}
        return replace(self, endpoints=eps)

    def bound_tcp(self) -> list[str]:
        """The tcp:// addresses this node binds."""
        return [ep.address for ep in self.endpoints.values()
                if ep.bind and ep.address.startswith("tcp://")]

    def host(self) -> str | None:
        """The host this node binds its tcp endpoints on (None without any): where it runs
        for its peers, and where it hosts a rendezvous (a trainer)."""
        bound = self.bound_tcp()
        return tcp_host(bound[0]) if bound else None

    def connects_to(self, addresses: Collection[str]) -> bool:
        """Whether any endpoint of this node connects to one of `addresses`."""
        return any(not ep.bind and {ep.address, *ep.also} & set(addresses)
                   for ep in self.endpoints.values())

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["endpoints"] = {k: v.to_dict() for k, v in self.endpoints.items()}
        return d

    @classmethod
    def from_dict(cls, d: Any) -> NodeSpec:
        if not isinstance(d, dict):
            raise SpecError(f"node spec must be a mapping, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        problems = [f"unknown field {k!r}" for k in d if k not in known]
        problems += [f"missing field {k!r}" for k in ("role", "node_id", "entry") if k not in d]
        endpoints = {}
        raw_endpoints = d.get("endpoints", {})
        if not isinstance(raw_endpoints, dict):
            problems.append("endpoints must be a mapping of name -> endpoint")
            raw_endpoints = {}
        for name, ep in raw_endpoints.items():
            try:
                endpoints[name] = Endpoint.from_dict(ep) if isinstance(ep, dict) else ep
            except (EndpointError, TypeError) as e:
                problems.append(f"endpoints.{name}: {e}")
        if problems:
            raise SpecError(f"node spec {d.get('node_id')!r}: " + "; ".join(problems))
        return cls(**{**d, "endpoints": endpoints})

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def read(cls, path: Path) -> NodeSpec:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except OSError as e:
            raise SpecError(f"cannot read node spec {path}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise SpecError(f"node spec {path} is not JSON: {e}") from None


def tcp_host(address: str) -> str:
    """`tcp://HOST:PORT` -> HOST (an IPv6 host without its brackets)."""
    return address.removeprefix("tcp://").rpartition(":")[0].strip("[]")
