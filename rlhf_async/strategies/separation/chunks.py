"""Prompt chunks and rollout batches as protocol messages (msgpack header + tensor frames).

A step's global batch is cut into chunks of whole prompt groups; every message names its
(step, chunk, chunks) so the trainer can reassemble the batch in chunk order, whichever
generator and scorer handled each part.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_async.modeling.rollout import PromptBatch, RolloutBatch, RolloutFormatError
from rlhf_async.wire.protocol import Message

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
