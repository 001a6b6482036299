"""The torch engine behind the request interface: batch-independent keyed tokens, abort,
pause, a commit mid-request, stop strings."""

from __future__ import annotations

import asyncio
from dataclasses import fields

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from rlhf_async.config.schema import GenerationConfig
from rlhf_async.engines import ENGINES, Request, engine_class
from rlhf_async.engines.torch.engine import TorchEngine
from rlhf_async.modeling.generation import SamplingParams, generate, request_seed, scaled_logprobs
from rlhf_async.modeling.models import cache_keyword, output_cache
from rlhf_async.modeling.rollout import PromptBatch

EOS, PAD = 3, 0


def _lm(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=128, n_embd=32, n_layer=1,
                                      n_head=2, eos_token_id=EOS, pad_token_id=PAD)).eval()


def _req(i: int, n: int = 12, prompt: tuple[int, ...] = (5, 6, 7)) -> Request:
    return Request(f"r{i}", prompt[: 1 + i % len(prompt)], n, request_seed(0, 1, i))


def _run(engine: TorchEngine, coro):
    async def main():
        try:
            return await coro()
        finally:
            await engine.close()
    return asyncio.run(main())


def test_the_registry_names_every_engine_and_imports_one_when_chosen():
    assert set(ENGINES) >= {"torch", "vllm"}
    # the config takes any name; the registry is the list (tests/unit/engines/test_registry_names.py)
    backend = next(f for f in fields(GenerationConfig) if f.name == "backend")
    assert backend.metadata["choices"] is None
    assert engine_class("torch") is TorchEngine
    with pytest.raises(ValueError, match="accepted: torch"):
        engine_class("nope")


def test_a_requests_tokens_do_not_depend_on_the_requests_beside_it_and_match_generate():
    lm = _lm()
    params = SamplingParams(max_new_tokens=12, eos_id=EOS, pad_id=PAD)
    engine = TorchEngine.serving(lm, params)

    async def go():
        alone = await engine.generate(_req(2))
        crowd = await asyncio.gather(*(engine.generate(_req(i)) for i in range(6)))
        return alone, crowd

    alone, crowd = _run(engine, go)
    assert crowd[2].token_ids == alone.token_ids
    assert crowd[2].logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    assert alone.versions == [0] * len(alone.token_ids)
    # the request keyed request_seed(seed, step, sample id) samples what generate samples
    ids = torch.tensor([[PAD, PAD, 5, 6, 7]])
    row = PromptBatch(ids, (ids != PAD).long(), torch.tensor([2]), torch.tensor([0]))
    ref = generate(lm, row, params, seed=0, step=1, version=0)
    n = int(ref.response_mask.sum())
    assert crowd[2].token_ids == ref.response_ids[0, :n].tolist()


def test_abort_frees_the_row_and_returns_what_it_sampled():
    params = SamplingParams(max_new_tokens=100, eos_id=99, pad_id=PAD)  # no EOS: 100 tokens
    engine = TorchEngine.serving(_lm(), params)

    async def go():
        long = asyncio.ensure_future(engine.generate(_req(0, 100)))
        while engine._batch.rows == 0:  # admitted: decoding
            await asyncio.sleep(0.0005)
        await engine.pause()  # held mid-response
        await engine.abort("r0")
        cut = await long
        await engine.resume()
        after = await engine.generate(_req(1, 5))  # the engine goes on
        return cut, after

    cut, after = _run(engine, go)
    assert cut.finish == "abort" and 0 < len(cut.token_ids) < 100
    assert len(cut.logprobs) == len(cut.versions) == len(cut.token_ids)
    assert after.finish == "length" and len(after.token_ids) == 5


def test_a_cancelled_generate_frees_its_row():
    params = SamplingParams(max_new_tokens=100, eos_id=99, pad_id=PAD)
    engine = TorchEngine.serving(_lm(), params)

    async def go():
        job = asyncio.ensure_future(engine.generate(_req(0, 100)))
        while engine._batch.rows == 0:
            await asyncio.sleep(0.0005)
        await engine.pause()
        job.cancel()
        await asyncio.sleep(0.01)
        await engine.resume()  # the abort queued by the cancel went first
        return engine._batch.rows, await engine.generate(_req(1, 3))

    rows, after = _run(engine, go)
    assert rows == 0 and len(after.token_ids) == 3


def test_pause_holds_decoding_until_resume():
    params = SamplingParams(max_new_tokens=30, eos_id=99, pad_id=PAD)
    engine = TorchEngine.serving(_lm(), params)

    async def go():
        await engine.pause()
        job = asyncio.ensure_future(engine.generate(_req(0, 30)))
        await asyncio.sleep(0.3)
        held = job.done()
        await engine.resume()
        return held, await job

    held, got = _run(engine, go)
    assert not held and len(got.token_ids) == 30


def test_a_commit_mid_request_switches_later_tokens_to_the_new_weights():
    old, new = _lm(0), _lm(1)
    params = SamplingParams(max_new_tokens=60, eos_id=99, pad_id=PAD, temperature=0.7)
    engine = TorchEngine.serving(old, params)
    staged = (5, {k: v.clone() for k, v in new.state_dict().items()})

    async def go():
        job = asyncio.ensure_future(engine.generate(_req(1, 60)))
        while engine._batch.rows == 0:  # admitted: decoding
            await asyncio.sleep(0.0005)
        await engine.pause()  # (so that it cannot end before the commit)
        version = await engine.commit(staged)
        await engine.resume()
        return version, await job

    version, got = _run(engine, go)
    assert version == 5 and engine.version == 5
    swap = got.versions.index(5)
    assert swap > 0 and set(got.versions[:swap]) == {0} and set(got.versions[swap:]) == {5}
    # recompute: tokens before the swap from the old weights; after it, the new weights
    # on top of the KV cache the old ones wrote (what the engine kept)
    P = 2  # _req(1)'s prompt: (5, 6)
    seq = torch.tensor([[5, 6, *got.token_ids]])
    with torch.no_grad():
        before = _lm(0)(seq[:, : P + swap]).logits
        pre = _lm(0)(seq[:, : P + swap - 1], use_cache=True)
        after = new(seq[:, P + swap - 1:], **{cache_keyword(new): output_cache(pre)}).logits
    logits = torch.cat([before[:, P - 1: P - 1 + swap], after[:, : len(got.token_ids) - swap]],
                       dim=1)
    lp = scaled_logprobs(logits[0], params)
    want = lp.gather(1, torch.tensor(got.token_ids)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(got.logprobs), want, atol=2e-4, rtol=1e-4)


def test_a_stop_string_ends_the_request_at_the_token_completing_it():
    def decode(ids: list[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids)

    lm = _lm()
    free = TorchEngine.serving(lm, SamplingParams(max_new_tokens=20, eos_id=99, pad_id=PAD))
    ran = _run(free, lambda: free.generate(_req(0, 20)))
    stop = decode(ran.token_ids[4:6])  # a string the free run completes at token 6
    first = next(i for i in range(1, 21) if stop in decode(ran.token_ids[:i]))
    params = SamplingParams(max_new_tokens=20, eos_id=99, pad_id=PAD, stop_strings=(stop,),
                            decode=decode)
    engine = TorchEngine.serving(lm, params)
    got = _run(engine, lambda: engine.generate(_req(0, 20)))
    assert got.token_ids == ran.token_ids[:first] and got.finish == "stop"
