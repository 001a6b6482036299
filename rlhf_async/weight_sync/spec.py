"""Rendezvous data for one weight-sync group, as plain data the coordinator ships.

Why a separate value: the coordinator decides who is in the group (address, port, world
size, ranks, epoch) and ships it over ZeroMQ; the sender and receivers only consume it.
Keeping it a small validated dataclass with `to_dict`/`from_dict` keeps pickle off the wire
and turns a bad message into one clear error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from rlhf_async.weight_sync.errors import WeightSyncPlanError

BACKENDS = ("gloo", "nccl")


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """Who is in a weight-sync group. Rank 0 is always the sender (trainer rank 0).

    `master_port = 0` lets the sender's `prepare` pick a free port; it returns the spec with
    the real port, which is what the coordinator then hands to the receivers. `peers[r]` is
    a human name for rank r used in error messages ("trainer", "generator g1").
    """

    backend: str
    master_addr: str
    master_port: int
    world_size: int
    name: str = "actor"
    epoch: int = 0
    timeout_s: float = 60.0
    peers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        problems = _problems(self)
        if problems:
            raise WeightSyncPlanError("invalid weight-sync group spec: " + "; ".join(problems))

    @property
    def group_name(self) -> str:
        """Name of this incarnation of the group, also its store prefix: 'actor@3'."""
        return f"{self.name}@{self.epoch}"

    def describe(self, rank: int) -> str:
        """'rank 2 (generator g1)' for error messages."""
        if rank < len(self.peers):
            return f"rank {rank} ({self.peers[rank]})"
        return f"rank {rank}"

    def with_epoch(self, epoch: int) -> GroupSpec:
        return dataclasses.replace(self, epoch=epoch)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["peers"] = list(self.peers)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GroupSpec:
        if not isinstance(data, Mapping):
            raise WeightSyncPlanError(
                f"invalid weight-sync group spec: expected a mapping, got {type(data).__name__}"
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        required = {"backend", "master_addr", "master_port", "world_size"}
        problems = [f"unknown key {k!r}" for k in sorted(set(data) - fields, key=str)]
        problems += [f"missing key {k!r}" for k in sorted(required - set(data))]
        if problems:
            raise WeightSyncPlanError(
                "invalid weight-sync group spec: "
                + "; ".join(problems)
                + f" (accepted keys: {', '.join(sorted(fields))})"
            )
        kwargs = dict(data)
        if isinstance(kwargs.get("peers"), list | tuple):
            kwargs["peers"] = tuple(kwargs["peers"])
        return cls(**kwargs)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _problems(spec: GroupSpec) -> list[str]:
    problems = []
    if spec.backend not in BACKENDS:
        problems.append(f"backend {spec.backend!r} not supported (accepted: {', '.join(BACKENDS)})")
    if not isinstance(spec.master_addr, str) or not spec.master_addr:
        problems.append(f"master_addr must be a non-empty host string, got {spec.master_addr!r}")
    if not _is_int(spec.master_port) or not 0 <= spec.master_port <= 65535:
        problems.append(f"master_port must be an integer in 0..65535, got {spec.master_port!r}")
    if not _is_int(spec.world_size) or spec.world_size < 2:
        problems.append(
            f"world_size must be an integer >= 2 (sender + receivers), got {spec.world_size!r}"
        )
    if not isinstance(spec.name, str) or not spec.name or "/" in spec.name:
        problems.append(f"name must be a non-empty string without '/', got {spec.name!r}")
    if not _is_int(spec.epoch) or spec.epoch < 0:
        problems.append(f"epoch must be an integer >= 0, got {spec.epoch!r}")
    if (
        not isinstance(spec.timeout_s, int | float)
        or isinstance(spec.timeout_s, bool)
        or not (spec.timeout_s > 0)
    ):
        problems.append(f"timeout_s must be a number > 0, got {spec.timeout_s!r}")
    peers_ok = isinstance(spec.peers, tuple) and all(isinstance(p, str) for p in spec.peers)
    if not peers_ok:
        problems.append(f"peers must be a list of names, got {spec.peers!r}")
    elif spec.peers and _is_int(spec.world_size) and len(spec.peers) != spec.world_size:
        problems.append(f"peers has {len(spec.peers)} names for world_size {spec.world_size}")
    return problems
