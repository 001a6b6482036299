"""The weights a generator serves: spans of the versions a chunk's tokens came from, and
commits mid-chunk on the torch engine (partial rollouts)."""

import asyncio

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from nodes.generator.inflight import Span, Weights
from nodes.generator.scheduler import Scheduler
from rlhf_async.engines.torch.engine import TorchEngine
from rlhf_async.modeling.generation import SamplingParams
from rlhf_async.modeling.rollout import PromptBatch
from rlhf_async.pipeline.protocol import SFT_LINEAGE, ChunkId

EOS, PAD = 3, 0


def test_a_chunk_over_two_trainer_lineages_belongs_to_no_trainer():
    assert Span([(3, "A")]).lineage() == "A"
    assert Span([(0, SFT_LINEAGE), (1, "B")]).lineage() == "B"
    assert Span([(2, "A"), (2, "B")]).lineage() == "A+B"


def test_a_span_takes_the_offered_updates_its_tokens_show():
    span = Span([(1, "A")], offered=[(2, "A"), (3, "B")])
    span.settle({1, 2})
    assert span.held == [(1, "A"), (2, "A")] and span.swaps == 1 and span.offered == []


def test_chunks_overlap_in_the_torch_engine_and_an_update_goes_in_between_steps():
    torch.manual_seed(0)
    lm = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=128, n_embd=32, n_layer=1,
                                    n_head=2, eos_token_id=EOS, pad_token_id=PAD))
    params = SamplingParams(max_new_tokens=80, eos_id=100, pad_id=PAD)  # no EOS: 80 tokens
    fresh = {k: v.clone() for k, v in lm.state_dict().items()}

    async def main():
        engine = TorchEngine.serving(lm, params)
        weights = Weights(engine, partial=True)
        sched = Scheduler(engine, weights, params, seed=0, slots=8)
        ids = torch.arange(12).reshape(4, 3) % 10 + 4
        chunks = [asyncio.ensure_future(sched.run(ChunkId(s, 0, 1), PromptBatch(
            ids, torch.ones_like(ids), torch.arange(4) + 4 * s, torch.arange(4) // 2)))
            for s in (0, 1)]
        while engine._batch.rows == 0:  # decoding has begun
            await asyncio.sleep(0.0005)
        await engine.pause()  # (so that no chunk can end before the commit)
        version = await weights.commit((7, fresh), 7, "L")
        await engine.resume()
        got = await asyncio.gather(*chunks)
        await engine.close()
        return got, version

    got, version = asyncio.run(main())
    assert version == 7
    for batch, span in got:
        assert batch.response_mask.sum() == 4 * 80
        assert batch.token_versions is not None and (batch.token_versions >= 0).all()
        assert batch.version == int(batch.token_versions.min())
        assert set(batch.token_versions.unique().tolist()) == {v for v, _ in span.held}
    # the update went in while the chunks decoded: their later tokens are version 7
    assert all(span.swaps == 1 and span.lineage() == "L" for _, span in got)
