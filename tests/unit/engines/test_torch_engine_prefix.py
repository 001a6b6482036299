"""The torch engine keeps an episode's KV across its turns: the same tokens as a full
re-prefill every turn, and never KV of weights it no longer serves."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from rlhf_async.engines import Completion, Prefill, Request, make_engine
from rlhf_async.engines.torch.engine import TorchEngine
from rlhf_async.modeling.generation import SamplingParams, request_seed

EOS, PAD = 3, 0
PARAMS = SamplingParams(max_new_tokens=10, eos_id=EOS, pad_id=PAD, temperature=0.8)
ENV = (9, 10, 11)  # an environment turn's tokens


def _lm(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=128, n_embd=32, n_layer=2,
                                      n_head=2, bos_token_id=1, eos_token_id=EOS,
                                      pad_token_id=PAD)).eval()


async def _turn(engine: TorchEngine, sid: int, k: int, conv: list[int],
                salt: str = "sft:0") -> Completion:
    return await engine.generate(Request(f"{sid}/{k}", tuple(conv), PARAMS.max_new_tokens,
                                         request_seed(0, 1, sid, turn=k), cache_salt=salt))


async def _episode(engine: TorchEngine, sid: int, prompt: list[int], turns: int = 3,
                   ) -> list[Completion]:
    """`turns` policy turns, each prompted with the whole conversation so far."""
    conv, out = list(prompt), []
    for k in range(turns):
        got = await _turn(engine, sid, k, conv)
        out.append(got)
        conv += got.token_ids + list(ENV)
    return out


def _played(prefix_cache_mb: int) -> tuple[list[list[Completion]], TorchEngine]:
    engine = TorchEngine.serving(_lm(), PARAMS, prefix_cache_mb=prefix_cache_mb)

    async def go():
        try:  # three episodes at once, one starting late: fresh and kept rows admitted together
            first = asyncio.ensure_future(_episode(engine, 0, [5, 6, 7]))
            second = asyncio.ensure_future(_episode(engine, 1, [4, 4, 8, 2, 5]))
            await asyncio.sleep(0.02)
            return [await first, await second, await _episode(engine, 2, [6])]
        finally:
            await engine.close()
    return asyncio.run(go()), engine


def test_a_three_turn_episode_with_kept_kv_samples_what_a_full_prefill_samples():
    kept, engine = _played(prefix_cache_mb=64)
    full, plain = _played(prefix_cache_mb=0)
    for ep_kept, ep_full in zip(kept, full, strict=True):
        for a, b in zip(ep_kept, ep_full, strict=True):
            assert a.token_ids == b.token_ids and a.finish == b.finish
            # decode-step KV against one prefill pass: float rounding only
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    # every later turn of every episode reused its earlier turns' KV (all but the one
    # token left to prefill per kept turn: its last sampled token, never fed)
    assert engine.prefixes.hits == 3 * 2 and plain.prefixes.hits == 0
    reused = sum(len(p) + sum(len(c.token_ids) + len(ENV) for c in ep[:k]) - len(ENV) - 1
                 for ep, p in zip(kept, ([5, 6, 7], [4, 4, 8, 2, 5], [6]), strict=True)
                 for k in (1, 2))
    assert engine.prefixes.reused_tokens == reused


def test_a_weight_update_between_turns_forces_a_full_prefill():
    new = {k: v.clone() for k, v in _lm(1).state_dict().items()}

    def play(prefix_cache_mb: int) -> tuple[list[Completion], TorchEngine]:
        engine = TorchEngine.serving(_lm(), PARAMS, prefix_cache_mb=prefix_cache_mb)

        async def go():
            try:
                conv, out = [5, 6, 7], []
                for k in range(3):
                    if k == 1:  # between turns 0 and 1: the KV of turn 0 is version 0's
                        await engine.commit((1, new))
                        assert len(engine.prefixes) == 0  # dropped at the commit
                    got = await _turn(engine, 0, k, conv, salt="sft:0")
                    out.append(got)
                    conv += got.token_ids + list(ENV)
                return out
            finally:
                await engine.close()
        return asyncio.run(go()), engine

    kept, engine = play(64)
    full, _ = play(0)
    assert [c.token_ids for c in kept] == [c.token_ids for c in full]
    for a, b in zip(kept, full, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert kept[1].versions == [1] * len(kept[1].token_ids)
    # turn 1 prefilled in full (a miss); turn 2 reused turn 1's KV, computed by version 1
    assert (engine.prefixes.hits, engine.prefixes.misses) == (1, 2)


def test_kv_is_reused_only_under_its_own_salt_and_for_the_same_tokens():
    engine = TorchEngine.serving(_lm(), PARAMS)

    async def go():
        try:
            got = await _turn(engine, 0, 0, [5, 6, 7])
            conv = [5, 6, 7, *got.token_ids, *ENV]
            await _turn(engine, 0, 1, conv, salt="other:0")  # another lineage: a miss
            diverged = [5, 6, 8, *got.token_ids, *ENV]
            await _turn(engine, 0, 1, diverged)  # not its tokens: a miss
            return await _turn(engine, 0, 1, conv)  # a hit
        finally:
            await engine.close()

    asyncio.run(go())
    assert (engine.prefixes.hits, engine.prefixes.misses) == (1, 3)


def test_the_config_budget_reaches_the_torch_engine_and_other_engines_ignore_it(tmp_path):
    _lm().save_pretrained(tmp_path)
    engine = make_engine("torch", str(tmp_path), PARAMS, dtype="float32", tensor_parallel=1,
                         sync_backend="gloo", device="cpu", prefix_cache_mb=3,
                         a_setting_of_another_engine=1)
    try:
        assert engine.prefixes.budget == 3 << 20 and engine.capabilities.prefix_cache
    finally:
        asyncio.run(engine.close())


def test_a_request_whose_decode_crossed_a_commit_keeps_no_kv():
    params = SamplingParams(max_new_tokens=40, eos_id=99, pad_id=PAD)  # no EOS: 40 tokens
    engine = TorchEngine.serving(_lm(), params)
    new = {k: v.clone() for k, v in _lm(1).state_dict().items()}

    async def go():
        try:
            job = asyncio.ensure_future(engine.generate(Request(
                "a", (5, 6, 7), 40, request_seed(0, 1, 0), cache_salt="s")))
            while engine._batch.rows == 0:  # admitted: decoding under version 0
                await asyncio.sleep(0.0005)
            await engine.pause()
            await engine.commit((1, new))
            await engine.resume()
            cut = await job
            kept_after = len(engine.prefixes)
            whole = await engine.generate(Request("b", (5, 6), 40, request_seed(0, 1, 1),
                                                  cache_salt="s"))
            return cut, kept_after, whole
        finally:
            await engine.close()

    cut, kept_after, whole = asyncio.run(go())
    assert {0, 1} <= set(cut.versions)  # its KV came from two weight versions
    assert kept_after == 0
    assert set(whole.versions) == {1} and len(engine.prefixes) == 1  # one version's: kept


def test_each_completion_says_what_its_prefill_reused():
    kept, engine = _played(prefix_cache_mb=64)
    full, _ = _played(prefix_cache_mb=0)
    prompts = ([5, 6, 7], [4, 4, 8, 2, 5], [6])
    for ep_kept, ep_full, prompt in zip(kept, full, prompts, strict=True):
        conv = list(prompt)
        for k, (a, b) in enumerate(zip(ep_kept, ep_full, strict=True)):
            # turn k's prompt is the conversation; its earlier turns' KV (all but the last
            # sampled token, never fed) was kept from turn k - 1
            reused = 0 if k == 0 else len(conv) - len(ENV) - 1
            assert a.prefill == Prefill.of(len(conv), reused)
            assert b.prefill == Prefill(len(conv), 0, 0, 1)  # no cache: all prefilled
            conv += a.token_ids + list(ENV)
    total = sum((c.prefill for ep in kept for c in ep), Prefill())
    assert (total.hits, total.misses) == (engine.prefixes.hits, engine.prefixes.misses)
    assert total.reused == engine.prefixes.reused_tokens


def test_kv_taken_before_a_commit_but_admitted_after_it_is_not_counted_as_reused():
    """The weights changed between a request's lookup and its admission: its prompt is
    prefilled in full, and its completion says so."""
    new = {k: v.clone() for k, v in _lm(1).state_dict().items()}
    engine = TorchEngine.serving(_lm(), PARAMS)

    async def go():
        try:
            first = await _turn(engine, 0, 0, [5, 6, 7])
            conv = [5, 6, 7, *first.token_ids, *ENV]
            await engine.pause()
            job = asyncio.ensure_future(_turn(engine, 0, 1, conv))  # looked up: version 0's
            while engine.prefixes.hits == 0:  # its lookup ran (admission waits: paused)
                await asyncio.sleep(0.001)
            await engine.commit((1, new))
            await engine.resume()
            return conv, await job
        finally:
            await engine.close()

    conv, second = asyncio.run(go())
    assert engine.prefixes.hits == 1  # the lookup found it...
    assert second.prefill == Prefill(len(conv), 0, 0, 1)  # ...its admission could not use it
    assert set(second.versions) == {1}
