"""The Separation pipeline's control messages: what nodes tell the coordinator (events) and
what the coordinator asks of nodes (commands), as typed records.

Both sides use this module: a node sends `await emit(node, Generated(...))`, the Driver
reads `decode(event.kind, event.payload)`. A payload with a missing, unknown or wrongly
typed field raises `EventError` naming the field and the record, so a mismatch between the
two sides fails at the first message with a clear line instead of a KeyError mid-run.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from rlhf_async.control.client import NodeDead

# Lineage names which trainer incarnation produced the weights behind a rollout: a trainer
# restarted from a checkpoint refuses rollouts made by weights its predecessor published
# after that checkpoint (same version number, different weights). Version 0 is the SFT
# policy, the same for every incarnation.
SFT_LINEAGE = "sft"


class EventError(ValueError):
    """A control payload that does not match its record."""


class Emitter(Protocol):
    async def emit(self, kind: str, payload: Any = None, *, step: int = 0,
                   weight_version: int = 0) -> None: ...


class StoppableEmitter(Emitter, Protocol):
    async def wait_stop(self) -> Any: ...


# ---- events: node -> coordinator (and the coordinator's own `NodeDead`) -------------------

@dataclass(frozen=True)
class Loaded:
    """A node has its models; the trainer says which step it restored and its lineage."""

    kind: ClassVar[str] = "loaded"
    step: int = 0
    version: int = 0
    lineage: str = SFT_LINEAGE


@dataclass(frozen=True)
class Generated:
    kind: ClassVar[str] = "generated"
    step: int
    chunk: int
    chunks: int
    version: int
    busy_s: float
    idle_s: float


@dataclass(frozen=True)
class Scored:
    kind: ClassVar[str] = "scored"
    step: int
    chunk: int
    chunks: int
    busy_s: float
    idle_s: float


@dataclass(frozen=True)
class ChunkDropped:
    """The trainer refused a chunk (too stale, or weights of a dead predecessor): send it
    again."""

    kind: ClassVar[str] = "chunk_dropped"
    step: int
    chunk: int
    chunks: int
    version: int


@dataclass(frozen=True)
class Trained:
    """One step trained; written to metrics by the Driver, exactly-once counted from
    `sample_ids`."""

    kind: ClassVar[str] = "trained"
    step: int
    metrics: dict[str, float]
    sample_ids: list[int]
    rollout_version: int
    queue_trainer: int
    weight_sync_s: float
    weight_sync_bytes: int
    busy_s: float
    idle_s: float
    staleness: dict[str, float] = field(default_factory=dict)  # StalenessPolicy.metrics()
    staleness_hist: dict[str, int] = field(default_factory=dict)
    published_version: int | None = None


@dataclass(frozen=True)
class Published:
    """The trainer is broadcasting new weights; the Driver forwards the plan to generators."""

    kind: ClassVar[str] = "publish"
    plan: dict[str, Any]
    lineage: str


@dataclass(frozen=True)
class WeightsApplied:
    """A generator swapped in new weights; only now does the staleness gate see them."""

    kind: ClassVar[str] = "weights_applied"
    version: int
    lineage: str
    receive_s: float = 0.0
    swap_wait_s: float = 0.0


@dataclass(frozen=True)
class WeightSyncFailed:
    kind: ClassVar[str] = "weight_sync_failed"
    error: str
    version: int | None = None


@dataclass(frozen=True)
class Failed:
    """A node hit an error that a restart would only repeat (the user's reward function, a
    full disk): the Driver stops the run with `error` instead of restarting the node."""

    kind: ClassVar[str] = "failed"
    error: str


@dataclass(frozen=True)
class Done:
    kind: ClassVar[str] = "done"
    policy_dir: str
    steps: int


Event = (Loaded | Generated | Scored | ChunkDropped | Trained | Published | WeightsApplied |
         WeightSyncFailed | Failed | Done | NodeDead)
EVENTS: dict[str, Any] = {c.kind: c for c in typing.get_args(Event)}


# ---- commands: coordinator -> node --------------------------------------------------------

@dataclass(frozen=True)
class WeightSyncPrepare:
    kind: ClassVar[str] = "weight_sync_prepare"
    spec: dict[str, Any]


@dataclass(frozen=True)
class WeightSyncConnect:
    kind: ClassVar[str] = "weight_sync_connect"
    spec: dict[str, Any]
    rank: int = 0  # generators join as 1..n; the trainer is rank 0


@dataclass(frozen=True)
class UpdateWeights:
    kind: ClassVar[str] = "update_weights"
    plan: dict[str, Any]
    lineage: str


@dataclass(frozen=True)
class TrainGroupPrepare:
    """Rank 0 of a multi-rank trainer: pick the port its group meets on."""

    kind: ClassVar[str] = "train_group_prepare"


@dataclass(frozen=True)
class TrainGroupConnect:
    """Every trainer rank: join the trainer group at addr:port (replied once it is formed)."""

    kind: ClassVar[str] = "train_group_connect"
    addr: str
    port: int
    rank: int
    world: int
    timeout_s: float = 120.0  # for every rank to arrive


@dataclass(frozen=True)
class Republish:
    kind: ClassVar[str] = "republish"


Command = (WeightSyncPrepare | WeightSyncConnect | UpdateWeights | TrainGroupPrepare |
           TrainGroupConnect | Republish)
COMMANDS: dict[str, Any] = {c.kind: c for c in typing.get_args(Command)}


# ---- encoding ------------------------------------------------------------------------------

def encode(record: Event | Command) -> dict[str, Any]:
    return dataclasses.asdict(record)


async def emit(node: Emitter, event: Event, *, step: int = 0, weight_version: int = 0) -> None:
    await node.emit(event.kind, encode(event), step=step, weight_version=weight_version)


async def fail(node: StoppableEmitter, error: str) -> None:
    """Report an error that a restart would repeat, then wait for the Driver to stop the
    run: exiting instead would have the coordinator restart the node into the same error
    (runtime.restart_limit times) and the cause would end up only in the node's log."""
    await emit(node, Failed(error))
    await node.wait_stop()


def decode_event(kind: str, payload: Any) -> Event:
    """The typed event behind (kind, payload); EventError when it is not one we know."""
    if kind not in EVENTS:
        raise EventError(f"unknown event kind {kind!r}; known: {', '.join(EVENTS)}")
    return _build(EVENTS[kind], payload)


def decode_command(kind: str, payload: Any) -> Any:
    if kind not in COMMANDS:
        raise EventError(f"unknown command {kind!r}; known: {', '.join(COMMANDS)}")
    return _build(COMMANDS[kind], payload)


def _build(cls: Any, payload: Any) -> Any:  # cls: one of the records above
    payload = {} if payload is None else payload
    if not isinstance(payload, dict):
        raise EventError(f"{cls.kind}: payload must be a mapping, got {type(payload).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(payload) - set(fields))
    if unknown:
        raise EventError(f"{cls.kind}: unknown field(s) {unknown}; accepted: {', '.join(fields)}")
    missing = [n for n, f in fields.items() if n not in payload and
               f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise EventError(f"{cls.kind}: missing field(s) {missing}")
    for name, value in payload.items():
        if not _matches(hints[name], value):
            raise EventError(f"{cls.kind}.{name}: expected {hints[name]}, got {value!r:.80}")
    return cls(**payload)


def _matches(tp: Any, value: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(t, value) for t in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is Any:
        return True
    if origin is dict:
        kt, vt = typing.get_args(tp)
        return isinstance(value, dict) and all(_matches(kt, k) and _matches(vt, v)
                                               for k, v in value.items())
    if origin is list:
        (it,) = typing.get_args(tp)
        return isinstance(value, list) and all(_matches(it, v) for v in value)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)
