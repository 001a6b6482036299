"""Our VLLMEngine's tokens/s vs vLLM's AsyncLLM driven directly, same prompts and sampling.

Runs in the vLLM venv (see `.ci/run` for how it is built):

    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python bench/vllm_engine_tps.py \
        [--requests 32] [--tokens 128] [--out bench/results/vllm_engine_tps.json]

A GPT-2 made here (4 layers, 256 wide, head_dim 64, 1024 tokens) is served twice, one
engine at a time: through `VLLMEngine.generate` (our request interface: per-request seeds,
processed log-probs, per-token versions) and through `AsyncLLM.generate` with the same
engine arguments and sampling parameters. Every request is submitted at once and runs to
exactly --tokens tokens (min = max), so both sides generate the same number of tokens;
one timed run each after an untimed warm-up batch of the same requests (the first
batch pays one-time costs: without it the engine timed second won by up to 1.4x). What the ratio measures is our wrapper's cost
(asyncio, per-token bookkeeping) over vLLM's own continuous batching.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from rlhf_async.engines.interface import Request
from rlhf_async.engines.vllm_engine import VLLMEngine
from rlhf_async.modeling.generation import SamplingParams

VOCAB, EOS = 1024, 1
WARM = 16  # tokens per request of the untimed warm-up batch (same concurrency as the run)


def _save_model(d: str) -> None:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=512, n_embd=256, n_layer=4,
                                  n_head=4, bos_token_id=0, eos_token_id=EOS)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(d, safe_serialization=True)


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, VOCAB, (16,), generator=g).tolist() for _ in range(n)]


async def _ours(d: str, prompts: list[list[int]], tokens: int) -> float:
    params = SamplingParams(max_new_tokens=tokens, eos_id=EOS, pad_id=0, temperature=1.0)
    engine = VLLMEngine(d, params, dtype="float32", tensor_parallel=1, sync_backend="gloo",
                        device="cpu", max_model_len=512)
    try:
        def req(i: int, p: list[int], n: int, tag: str = "r") -> Request:
            return Request(f"{tag}{i}", tuple(p), n, seed=i, min_new_tokens=n)

        await asyncio.gather(*(engine.generate(req(i, p, WARM, "w"))
                               for i, p in enumerate(prompts)))
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(engine.generate(req(i, p, tokens)) for i, p in enumerate(prompts)))
        secs = time.perf_counter() - t0
    finally:
        await engine.close()
    return sum(len(o.token_ids) for o in outs) / secs


async def _direct(d: str, prompts: list[list[int]], tokens: int) -> float:
    from vllm import AsyncEngineArgs
    from vllm import SamplingParams as VSP
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=d, dtype="float32", skip_tokenizer_init=True, enforce_eager=True,
        logprobs_mode="processed_logprobs", enable_prefix_caching=True, max_model_len=512,
        gpu_memory_utilization=0.08, disable_log_stats=True))

    async def one(rid: str, p: list[int], n: int, seed: int) -> int:
        sp = VSP(temperature=1.0, max_tokens=n, min_tokens=n, stop_token_ids=[EOS],
                 logprobs=0, seed=seed, detokenize=False, output_kind=RequestOutputKind.DELTA)
        got = 0
        async for out in llm.generate(TokensPrompt(prompt_token_ids=p), sp, rid):
            got += len(out.outputs[0].token_ids)
        return got

    try:
        await asyncio.gather(*(one(f"w{i}", p, WARM, i) for i, p in enumerate(prompts)))
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(f"r{i}", p, tokens, i)
                                        for i, p in enumerate(prompts)))
        secs = time.perf_counter() - t0
    finally:
        llm.shutdown()
    return sum(counts) / secs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--direct-first", action="store_true", help="time AsyncLLM direct first")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    prompts = _prompts(args.requests)
    res: dict[str, Any] = {"requests": args.requests, "tokens_per_request": args.tokens,
                           "order": "direct, ours" if args.direct_first else "ours, direct"}
    with tempfile.TemporaryDirectory() as d:
        _save_model(d)
        runs = [("ours_tok_s", _ours), ("direct_tok_s", _direct)]
        for key, run in runs[::-1] if args.direct_first else runs:
            res[key] = asyncio.run(run(d, prompts, args.tokens))
    res["ratio"] = res["ours_tok_s"] / res["direct_tok_s"]
    res["loadavg"] = list(os.getloadavg())
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
