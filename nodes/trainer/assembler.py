"""Reassembles each step's global batch from chunks that arrive in any order.

Exactly-once lives here: a chunk of a step already trained, a chunk seen twice, or a chunk
holding a sample id already trained is refused, so a re-queued or duplicated chunk can
never be trained on twice.
"""

from __future__ import annotations

from rlhf_async.modeling.rollout import RolloutBatch
from rlhf_async.pipeline.protocol import ChunkId


class BatchAssembler:
    def __init__(self, next_step: int = 0) -> None:
        self.next_step = next_step  # the step the trainer trains next
        self.trained_ids: set[int] = set()
        self._chunks: dict[int, dict[int, RolloutBatch]] = {}
        self._declared: dict[int, int] = {}  # step -> chunks that make it whole

    def is_duplicate(self, cid: ChunkId, batch: RolloutBatch) -> bool:
        if cid.step < self.next_step or cid.chunk in self._chunks.get(cid.step, {}):
            return True
        return any(int(s) in self.trained_ids for s in batch.sample_ids)

    def add(self, cid: ChunkId, batch: RolloutBatch) -> bool:
        """Keep the chunk; False (and nothing kept) when it is a duplicate."""
        if self.is_duplicate(cid, batch):
            return False
        self._chunks.setdefault(cid.step, {})[cid.chunk] = batch
        self._declared[cid.step] = cid.chunks
        return True

    def pop_ready(self) -> RolloutBatch | None:
        """The next step's whole batch in chunk order, once every chunk arrived."""
        got = self._chunks.get(self.next_step, {})
        if not got or len(got) < self._declared[self.next_step]:
            return None
        del self._chunks[self.next_step], self._declared[self.next_step]
        batch = RolloutBatch.concat([got[c] for c in sorted(got)])
        self.trained_ids.update(int(s) for s in batch.sample_ids)
        self.next_step += 1
        return batch

    def waiting(self) -> int:
        """Chunks held for steps not yet trained (the trainer's queue depth)."""
        return sum(len(c) for c in self._chunks.values())
