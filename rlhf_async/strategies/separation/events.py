"""The Separation pipeline's control protocol: what nodes tell the coordinator (events),
what the coordinator asks of nodes (commands) and what they answer (replies), as typed,
tagged msgspec Structs (runtime/messages.py) in the control messages' meta.

A node sends `await node.send_event(Generated(...))`; the Driver reads `decode_event(ev)`; the
coordinator's clients (`clients.py`) send `Command[Reply]`s that nodes serve with
`node.handle(UpdateWeights, fn)`. A payload with a missing, unknown or wrongly typed field
raises `EventError` naming the record and the field, so a mismatch between the two sides
fails at the first message with a clear line instead of a KeyError mid-run.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from rlhf_async.control.client import NodeDead, NodeEvent, NodeExited, NodeReady, NodeRestarted
from rlhf_async.runtime.messages import Command, MessageError, Msg, from_payload, tag
from rlhf_async.weight_sync import GroupSpec

# Lineage names which trainer incarnation produced the weights behind a rollout: a trainer
# restarted from a checkpoint refuses rollouts made by weights its predecessor published
# after that checkpoint (same version number, different weights). Version 0 is the SFT
# policy, the same for every incarnation.
SFT_LINEAGE = "sft"
EventError = MessageError  # a control payload that does not match its record


class Emitter(Protocol):
    async def send_event(self, event: Msg, *, step: int = 0,
                         weight_version: int = 0) -> None: ...


class StoppableEmitter(Emitter, Protocol):
    async def wait_stop(self) -> Any: ...


# ---- events: node -> coordinator (and the coordinator's own, control/client.py) ----------

class Loaded(Msg, frozen=True, tag="loaded"):
    """A node has its models; the trainer says which step it restored and its lineage."""

    step: int = 0
    version: int = 0
    lineage: str = SFT_LINEAGE


class Generated(Msg, frozen=True, tag="generated"):
    step: int
    chunk: int
    chunks: int
    version: int
    busy_s: float
    idle_s: float


class Scored(Msg, frozen=True, tag="scored"):
    step: int
    chunk: int
    chunks: int
    busy_s: float
    idle_s: float


class ChunkDropped(Msg, frozen=True, tag="chunk_dropped"):
    """The trainer refused a chunk (too stale, or weights of a dead predecessor): send it
    again."""

    step: int
    chunk: int
    chunks: int
    version: int


class WeightSync(Msg, frozen=True):
    """What one step's publication cost (zero when none was due)."""

    seconds: float = 0.0
    bytes: int = 0


class Trained(Msg, frozen=True, kw_only=True, tag="trained"):
    """One step trained; written to metrics by the Driver, exactly-once counted from
    `sample_ids`."""

    step: int
    metrics: dict[str, float]
    sample_ids: list[int]
    rollout_version: int
    queue_trainer: int  # scored chunks waiting at the trainer
    weight_sync: WeightSync
    busy_s: float
    idle_s: float
    staleness: dict[str, float] = msgspec.field(default_factory=dict)  # policy.metrics()
    staleness_hist: dict[str, int] = msgspec.field(default_factory=dict)


class Published(Msg, frozen=True, tag="publish"):
    """The trainer is broadcasting new weights; the Driver forwards the plan to generators."""

    plan: dict[str, Any]  # weight_sync.plan's bucket layout, validated by the receiver
    lineage: str


class WeightsApplied(Msg, frozen=True, tag="weights_applied"):
    """A generator swapped in new weights; only now does the staleness gate see them."""

    version: int
    lineage: str
    receive_s: float = 0.0
    swap_wait_s: float = 0.0


class WeightSyncFailed(Msg, frozen=True, tag="weight_sync_failed"):
    error: str
    version: int | None = None


class Failed(Msg, frozen=True, tag="failed"):
    """A node hit an error that a restart would only repeat (the user's reward function, a
    full disk): the Driver stops the run with `error` instead of restarting the node."""

    error: str


class Done(Msg, frozen=True, tag="done"):
    policy_dir: str
    steps: int


Event = (Loaded | Generated | Scored | ChunkDropped | Trained | Published | WeightsApplied |
         WeightSyncFailed | Failed | Done | NodeDead | NodeReady | NodeExited | NodeRestarted)
EVENTS: dict[str, type[Msg]] = {tag(c): c for c in (
    Loaded, Generated, Scored, ChunkDropped, Trained, Published, WeightsApplied,
    WeightSyncFailed, Failed, Done, NodeDead, NodeReady, NodeExited, NodeRestarted)}


# ---- commands: coordinator -> node, and their replies -------------------------------------

class Connected(Msg, frozen=True):
    group: str  # the group's name at its epoch


class Receiving(Msg, frozen=True):
    version: int


class Joined(Msg, frozen=True):
    rank: int
    world: int
    pid: int


class Republished(Msg, frozen=True):
    version: int | None = None  # None: the broadcast failed (reported on its own)


class WeightSyncPrepare(Command[GroupSpec], frozen=True, tag="weight_sync_prepare"):
    """The trainer: pick the group's port; replies the spec with it."""

    spec: GroupSpec


class WeightSyncConnect(Command[Connected], frozen=True, tag="weight_sync_connect"):
    spec: GroupSpec
    rank: int = 0  # generators join as 1..n; the trainer is rank 0


class UpdateWeights(Command[Receiving], frozen=True, tag="update_weights"):
    plan: dict[str, Any]
    lineage: str


class TrainGroupPrepare(Command[int], frozen=True, tag="train_group_prepare"):
    """Rank 0 of a multi-rank trainer: pick the port its group meets on."""


class TrainGroupConnect(Command[Joined], frozen=True, tag="train_group_connect"):
    """Every trainer rank: join the trainer group at addr:port (replied once it is formed)."""

    addr: str
    port: int
    rank: int
    world: int
    timeout_s: float  # for every rank to arrive


class Republish(Command[Republished], frozen=True, tag="republish"):
    """The trainer: broadcast the weights now (after a resume or a regrouped broadcast)."""


# ---- sending and reading ------------------------------------------------------------------

async def fail(node: StoppableEmitter, error: str) -> None:
    """Report an error that a restart would repeat, then wait for the Driver to stop the
    run: exiting instead would have the coordinator restart the node into the same error
    (runtime.restart_limit times) and the cause would end up only in the node's log."""
    await node.send_event(Failed(error))
    await node.wait_stop()


def decode_event(ev: NodeEvent) -> Event:
    """The typed event behind a node event; EventError when it is not one we know."""
    cls = EVENTS.get(ev.kind)
    if cls is None:
        raise EventError(f"unknown event kind {ev.kind!r}; known: {', '.join(EVENTS)}")
    return from_payload(cls, ev.payload)  # type: ignore[return-value]  # cls is in Event
