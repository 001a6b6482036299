"""The trainer's batch assembly: a step's chunks in any order make its batch in chunk order,
once each, and nothing already trained is kept again (exactly-once)."""

import torch

from nodes.trainer.assembler import BatchAssembler
from rlhf_async.modeling.rollout import PromptBatch, RolloutBatch
from rlhf_async.pipeline.protocol import ChunkId


def _prompts(n=8, step=0):
    ids = torch.arange(n * 3).reshape(n, 3)
    return PromptBatch(ids, torch.ones_like(ids), torch.arange(step * n, (step + 1) * n),
                       torch.arange(step * n, (step + 1) * n) // 2)


def _rollout(prompts: PromptBatch, version=0, step=0):
    B, R = len(prompts), 4
    return RolloutBatch(prompts.prompt_ids, prompts.prompt_mask, torch.ones(B, R, dtype=torch.long),
                        torch.ones(B, R, dtype=torch.long), torch.zeros(B, R),
                        prompts.sample_ids, prompts.group_ids, version=version, step=step,
                        rewards=torch.zeros(B), ref_logprobs=torch.zeros(B, R))


def test_assembler_orders_chunks_and_refuses_duplicates():
    asm = BatchAssembler()
    parts = _prompts(8).split(2, 2)
    later = _prompts(8, step=1).split(2, 2)
    assert asm.add(ChunkId(1, 0, 2), _rollout(later[0], step=1))  # a future step waits
    assert asm.add(ChunkId(0, 1, 2), _rollout(parts[1]))
    assert asm.pop_ready() is None
    assert not asm.add(ChunkId(0, 1, 2), _rollout(parts[1]))  # same chunk again
    assert asm.add(ChunkId(0, 0, 2), _rollout(parts[0]))
    batch = asm.pop_ready()
    assert batch.sample_ids.tolist() == list(range(8)) and asm.next_step == 1
    assert not asm.add(ChunkId(0, 0, 2), _rollout(parts[0]))  # step already trained
    assert asm.waiting() == 1 and asm.pop_ready() is None


def test_a_step_is_whole_only_with_every_declared_chunk_and_comes_out_in_chunk_order():
    asm = BatchAssembler()
    parts = _prompts(12).split(2, 3)  # 6 groups of 2: chunks of 4 rows
    assert [len(p) for p in parts] == [4, 4, 4]
    for c in (2, 0):
        assert asm.add(ChunkId(0, c, 3), _rollout(parts[c]))
        assert asm.pop_ready() is None
    assert asm.waiting() == 2
    assert asm.add(ChunkId(0, 1, 3), _rollout(parts[1]))
    batch = asm.pop_ready()
    # chunk 0's rows, then 1's, then 2's, whatever the order they came in
    assert batch.sample_ids.tolist() == list(range(12))
    assert batch.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert asm.waiting() == 0 and asm.pop_ready() is None
    assert asm.trained_ids == set(range(12))


def test_a_sample_trained_once_is_refused_under_any_chunk_id():
    asm = BatchAssembler()
    first = _prompts(4)
    assert asm.add(ChunkId(0, 0, 1), _rollout(first))
    assert asm.pop_ready() is not None
    # the same prompts re-sent as a chunk of the next step (a coordinator that lost track):
    # never trained twice, and nothing of it is kept
    again = _rollout(first, step=1)
    assert asm.is_duplicate(ChunkId(1, 0, 1), again)
    assert not asm.add(ChunkId(1, 0, 1), again)
    assert asm.waiting() == 0
    # one shared sample is enough to refuse the chunk
    mixed = PromptBatch(first.prompt_ids, first.prompt_mask, torch.tensor([3, 4, 5, 6]),
                        torch.tensor([1, 2, 2, 3]))
    assert not asm.add(ChunkId(1, 0, 1), _rollout(mixed, step=1))


def test_a_restored_trainer_starts_at_its_checkpoints_step():
    asm = BatchAssembler(next_step=5)  # restored from the checkpoint of step 5
    old = _prompts(4, step=4)
    assert not asm.add(ChunkId(4, 0, 1), _rollout(old, step=4))  # trained before the crash
    new = _prompts(4, step=5)
    assert asm.add(ChunkId(5, 0, 1), _rollout(new, step=5))
    assert asm.pop_ready().sample_ids.tolist() == [20, 21, 22, 23] and asm.next_step == 6
