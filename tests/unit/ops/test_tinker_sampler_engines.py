"""A Tinker sampler's engines (ops/tinker/sampling.py) are sized by the requests'
response-length class, not the model's whole context: an engine sized for 1024 tokens
copied that much KV per row at every admission (the API sampled at 0.3-0.6x our engine's
tokens/s with 64-token requests)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import torch

from rlhf_async.ops.tinker import schema
from rlhf_async.ops.tinker.base_models import BUILTIN, resolve
from rlhf_async.ops.tinker.sampling import Sampler, length_class


def test_the_length_class_is_the_power_of_two_at_or_above_the_request() -> None:
    assert [length_class(n, 1024) for n in (1, 5, 64, 65, 200, 1000)] == \
        [64, 64, 64, 128, 256, 1024]
    assert length_class(900, 600) == 600  # never past the model's context


def test_a_sampler_keeps_one_engine_per_length_class(tmp_path: Path, one_thread: None) -> None:
    base = resolve(BUILTIN, tmp_path / "models")
    sampler = Sampler("s", base, None, None, torch.device("cpu"))

    def request(max_tokens: int) -> schema.Sample:
        return schema.decode(json.dumps({
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
            "num_samples": 2, "base_model": BUILTIN,
            "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0, "seed": 1},
        }).encode(), schema.Sample, "asample")

    async def go() -> list[int]:
        for n in (5, 60, 100):
            await sampler.sample(f"r{n}", request(n))
        sizes = [e.params.max_new_tokens for e in sampler._engines.values()]
        await sampler.close()
        return sizes

    assert asyncio.run(go()) == [64, 128]
