"""The small interface every weight-sync backend implements, and the registry by name.

Why a registry: the trainer and generators pick the transfer by a config string ("gloo"
on CPU, "nccl" on GPUs, later e.g. one that lives inside an engine's own workers) without importing
backend modules they cannot load on this machine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import torch

from rlhf_async.weight_sync.broadcast import (
    ReceivedWeights,
    TorchBroadcastReceiver,
    TorchBroadcastSender,
)
from rlhf_async.weight_sync.errors import WeightSyncPlanError
from rlhf_async.weight_sync.spec import GroupSpec


class WeightSender(Protocol):
    """Trainer rank 0's end of a weight-sync group. `plan` needs only names, dtypes and
    shapes (meta tensors will do); `send` takes the tensors whole or as consecutive groups
    in plan order, finishing with each group before it asks for the next, so a sharded
    model is gathered ~`bucket_bytes` at a time."""

    bucket_bytes: int
    last_sent_bytes: int  # on the wire in the last send
    last_full_bytes: int  # a full update of the same weights (tied weights once)
    full_fallbacks: int  # updates sent whole though delta was on (after the first)

    def prepare(self, spec: GroupSpec) -> GroupSpec: ...
    def connect(self, spec: GroupSpec) -> None: ...
    def plan(self, tensors: Mapping[str, torch.Tensor], version: int,
             tied: Mapping[str, str] | None = None) -> dict[str, Any]: ...
    def send(
        self,
        tensors: Mapping[str, torch.Tensor] | Iterable[Mapping[str, torch.Tensor]],
        plan: Mapping[str, Any],
    ) -> None: ...
    def close(self) -> None: ...


class WeightReceiver(Protocol):
    """A generator's end of a weight-sync group."""

    def connect(self, spec: GroupSpec, rank: int) -> None: ...
    def receive(self, plan: Mapping[str, Any]) -> ReceivedWeights: ...
    def close(self) -> None: ...


SenderFactory = Callable[..., WeightSender]
ReceiverFactory = Callable[..., WeightReceiver]

_REGISTRY: dict[str, tuple[SenderFactory, ReceiverFactory]] = {}


def register_backend(name: str, sender: SenderFactory, receiver: ReceiverFactory) -> None:
    _REGISTRY[name] = (sender, receiver)


def _lookup(name: str) -> tuple[SenderFactory, ReceiverFactory]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise WeightSyncPlanError(
            f"unknown weight-sync backend {name!r} (accepted: {', '.join(sorted(_REGISTRY))})"
        ) from None


def make_sender(backend: str, **kwargs: Any) -> WeightSender:
    """E.g. `make_sender("gloo", bucket_mb=64)`; kwargs go to the backend's constructor."""
    return _lookup(backend)[0](**kwargs)


def make_receiver(backend: str, **kwargs: Any) -> WeightReceiver:
    return _lookup(backend)[1](**kwargs)


def backends() -> list[str]:
    return sorted(_REGISTRY)


for _name in ("gloo", "nccl"):
    register_backend(
        _name,
        lambda _b=_name, **kw: TorchBroadcastSender(_b, **kw),
        lambda _b=_name, **kw: TorchBroadcastReceiver(_b, **kw),
    )
