import pytest
import torch

from rlhf_async.modeling.rollout import PromptBatch, RolloutBatch
from rlhf_async.pipeline.protocol import (
    ChunkFormatError,
    ChunkId,
    prompts_from_message,
    prompts_message,
    rollout_from_message,
    rollout_message,
)
from rlhf_async.wire.protocol import decode, encode


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


def test_split_keeps_groups_whole_and_covers_the_batch():
    parts = _prompts(8).split(2, 3)
    assert [len(p) for p in parts] == [2, 2, 4]
    assert torch.cat([p.sample_ids for p in parts]).tolist() == list(range(8))
    assert len(_prompts(4).split(2, 8)) == 2


def test_messages_round_trip_through_the_wire():
    cid = ChunkId(3, 1, 2)
    got_cid, got = prompts_from_message(decode(encode(prompts_message(cid, _prompts(), "c"))))
    assert got_cid == cid and torch.equal(got.prompt_ids, _prompts().prompt_ids)
    msg = decode(encode(rollout_message("scored_rollout", cid, _rollout(_prompts(), 2), "s", "t1")))
    got_cid, batch = rollout_from_message(msg, "scored_rollout")
    assert got_cid == cid and batch.version == 2 and batch.rewards is not None


def test_malformed_chunks_are_refused_with_a_reason():
    msg = prompts_message(ChunkId(0, 0, 1), _prompts(), "c")
    msg.meta["chunk"] = 5
    with pytest.raises(ChunkFormatError, match="out of range"):
        prompts_from_message(msg)
    msg = prompts_message(ChunkId(0, 0, 1), _prompts(), "c")
    del msg.tensors["group_ids"]
    with pytest.raises(ChunkFormatError, match="needs tensors"):
        prompts_from_message(msg)
    unscored = rollout_message("scored_rollout", ChunkId(0, 0, 1),
                               _rollout(_prompts()).replace(rewards=None), "s", "t1")
    with pytest.raises(ChunkFormatError, match="lacks rewards"):
        rollout_from_message(unscored, "scored_rollout")

