"""The Separation pipeline's protocol, both planes. Control: what nodes tell the coordinator
(events), what the coordinator asks of nodes (commands) and what they answer (replies), as
typed, tagged msgspec Structs (runtime/messages.py) in the control messages' meta.

A node sends `await node.send_event(Generated(...))`; the Driver reads `decode_event(ev)`; the
coordinator's clients (`strategies/separation/clients.py`) send `Command[Reply]`s that
nodes serve with `node.handle(UpdateWeights, fn)`. A payload with a missing, unknown or
wrongly typed field raises `EventError` naming the record and the field, so a mismatch
between the two sides fails at the first message with a clear line instead of a KeyError
mid-run.

Data: prompt chunks and rollout batches as wire messages (msgpack header + tensor frames).
A step's global batch is cut into chunks of whole prompt groups; every message names its
(step, chunk, chunks) so the trainer can reassemble the batch in chunk order, whichever
generator and scorer handled each part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from rlhf_async.control.client import NodeDead, NodeEvent, NodeExited, NodeReady, NodeRestarted
from rlhf_async.modeling.rollout import PromptBatch, RolloutBatch, RolloutFormatError
from rlhf_async.runtime.messages import Command, MessageError, Msg, from_payload, tag
from rlhf_async.weight_sync import GroupSpec
from rlhf_async.wire.protocol import Message

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
    episode_error: str = ""  # the chunk's first failed episode's error ('' when none)


class Scored(Msg, frozen=True, tag="scored"):
    step: int
    chunk: int
    chunks: int
    busy_s: float
    idle_s: float


class Received(Msg, frozen=True, tag="received"):
    """The trainer holds this scored chunk: only from here is it past every node whose death
    could lose it (a node's event can arrive before the rollout it sent on another socket)."""

    step: int
    chunk: int
    chunks: int


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


Event = (Loaded | Generated | Scored | Received | ChunkDropped | Trained | Published
         | WeightsApplied | WeightSyncFailed | Failed | Done | NodeDead | NodeReady | NodeExited
         | NodeRestarted)
EVENTS: dict[str, type[Msg]] = {tag(c): c for c in (
    Loaded, Generated, Scored, Received, ChunkDropped, Trained, Published, WeightsApplied,
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


# ---- data plane: prompt chunks and rollout batches ----------------------------------------
PROMPT_FIELDS = ("prompt_ids", "prompt_mask", "sample_ids", "group_ids")


class ChunkFormatError(ValueError):
    """A data message whose chunk header or tensors are not what the pipeline accepts."""


@dataclass(frozen=True)
class ChunkId:
    step: int
    chunk: int
    chunks: int

    def meta(self) -> dict[str, int]:
        return {"step": self.step, "chunk": self.chunk, "chunks": self.chunks}

    @classmethod
    def from_meta(cls, meta: dict) -> ChunkId:
        vals = [meta.get(k) for k in ("step", "chunk", "chunks")]
        ints = [v for v in vals if isinstance(v, int) and not isinstance(v, bool) and v >= 0]
        if len(ints) != len(vals):
            raise ChunkFormatError(f"chunk header needs integers step, chunk, chunks >= 0; "
                                   f"got {vals}")
        cid = cls(*ints)
        if cid.chunk >= cid.chunks:
            raise ChunkFormatError(f"chunk {cid.chunk} out of range for {cid.chunks} chunks")
        return cid


def prompts_message(cid: ChunkId, prompts: PromptBatch, source: str) -> Message:
    return Message("prompts", meta=cid.meta(), source=source, step=cid.step,
                   tensors={f: getattr(prompts, f).contiguous() for f in PROMPT_FIELDS})


def prompts_from_message(msg: Message) -> tuple[ChunkId, PromptBatch]:
    if msg.kind != "prompts":
        raise ChunkFormatError(f"expected a 'prompts' message, got {msg.kind!r}")
    cid = ChunkId.from_meta(msg.meta)
    missing = [f for f in PROMPT_FIELDS if f not in msg.tensors]
    if missing or set(msg.tensors) != set(PROMPT_FIELDS):
        raise ChunkFormatError(f"prompts message needs tensors {list(PROMPT_FIELDS)}, "
                               f"got {sorted(msg.tensors)}")
    t = msg.tensors
    B = t["prompt_ids"].shape[0] if t["prompt_ids"].dim() == 2 else -1
    if B < 1 or t["prompt_mask"].shape != t["prompt_ids"].shape or \
            t["sample_ids"].shape != (B,) or t["group_ids"].shape != (B,):
        raise ChunkFormatError("prompts message tensors have inconsistent shapes: "
                               f"{ {k: tuple(v.shape) for k, v in t.items()} }")
    if any(v.is_floating_point() for v in t.values()):
        raise ChunkFormatError("prompts message tensors must be integer tensors")
    return cid, PromptBatch(*(t[f] for f in PROMPT_FIELDS))


def rollout_message(kind: str, cid: ChunkId, batch: RolloutBatch, source: str,
                    lineage: str) -> Message:
    return Message(kind, meta={**cid.meta(), "version": batch.version, "lineage": lineage},
                   source=source, step=cid.step, weight_version=batch.version,
                   tensors=batch.to_tensors())


def lineage_of(msg: Message) -> str:
    lineage = msg.meta.get("lineage")
    if not isinstance(lineage, str):
        raise ChunkFormatError(f"rollout message needs a string 'lineage', got {lineage!r}")
    return lineage


def rollout_from_message(msg: Message, kind: str) -> tuple[ChunkId, RolloutBatch]:
    if msg.kind != kind:
        raise ChunkFormatError(f"expected a {kind!r} message, got {msg.kind!r}")
    cid = ChunkId.from_meta(msg.meta)
    try:
        batch = RolloutBatch.from_tensors(msg.tensors, {"version": msg.meta.get("version"),  # type: ignore[dict-item]  # from_tensors checks it
                                                        "step": cid.step})
    except (RolloutFormatError, TypeError) as e:
        raise ChunkFormatError(f"{kind} message: {e}") from None
    if kind == "scored_rollout" and (batch.rewards is None or batch.ref_logprobs is None):
        raise ChunkFormatError("scored_rollout message lacks rewards or ref_logprobs")
    return cid, batch
