"""A Separation generator's sampling thread with continuous batching: chunks in, rollouts
out, a chunk sent again while it still decodes comes out twice, and a staged update is
copied in between two decode steps (each token records its version)."""

import asyncio

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from nodes.generator.continuous import ContinuousGeneration
from nodes.generator.inflight import InflightWeights
from rlhf_async.modeling.generation import SamplingParams
from rlhf_async.modeling.rollout import PromptBatch
from rlhf_async.strategies.separation.protocol import ChunkId

EOS, PAD = 3, 0


def prompts(rows: int, first: int) -> PromptBatch:
    ids = torch.arange(rows * 3).reshape(rows, 3) % 10 + 4
    sids = torch.arange(first, first + rows)
    return PromptBatch(ids, torch.ones_like(ids), sids, sids // 2)


def test_chunks_out_once_each_copy_and_updates_between_steps():
    torch.manual_seed(0)
    lm = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=128, n_embd=32, n_layer=1,
                                    n_head=2, eos_token_id=EOS, pad_token_id=PAD))
    copied = []

    def swap(staged):
        copied.append(staged)
        return staged

    held = InflightWeights(swap)
    params = SamplingParams(max_new_tokens=80, eos_id=100, pad_id=PAD)  # no EOS: 80 tokens

    async def main():
        runner = ContinuousGeneration(lm, params, held, slots=8, seed=0)
        worker = asyncio.ensure_future(asyncio.to_thread(runner.run))
        a, b = ChunkId(0, 0, 1), ChunkId(1, 0, 1)
        runner.submit(a, prompts(4, 0))
        runner.submit(b, prompts(4, 4))
        runner.submit(a, prompts(4, 0))  # sent again while the first copy decodes
        while runner.rows == 0:  # decoding has begun
            await asyncio.sleep(0.001)
        applied = held.offer(7, "L")
        runner.wake()
        got = [await asyncio.wait_for(runner.finished(), 60) for _ in range(3)]
        runner.close()
        await worker
        return got, applied.result()

    got, version = asyncio.run(main())
    assert sorted((c.step for c, _, _ in got)) == [0, 0, 1]
    assert version == 7 and copied == [7]
    for _, batch, span in got:
        assert batch.response_mask.sum() == 4 * 80
        assert (batch.token_versions >= 0).all()
        assert batch.version == int(batch.token_versions.min())
        # the span holds every version a token came from (from its submission on)
        assert set(batch.token_versions.unique().tolist()) <= {v for v, _ in span.held}
    # the update went in while the first chunks decoded: their later tokens are version 7
    assert any(bool((b.token_versions == 7).any()) and bool((b.token_versions == 0).any())
               for _, b, _ in got)
