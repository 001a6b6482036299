"""Multi-turn episodes on the torch engine with and without KV kept across turns.

    python -m bench.prefix_kv [--chunks 4] [--prompts 8] [--repeats 3]

Each policy turn of an episode is one engine request whose prompt is the whole
conversation so far, as the generator node sends it (`nodes/generator/scheduler.py`): with
`generation.prefix_cache_mb` > 0 the engine prefills only what came after the turn it
kept, with 0 every turn prefills the whole conversation. Two workloads, each both ways,
alternating, `--repeats` times after one untimed round (median episodes/s), on one thread:

- calculator: the calculator task's SFT policy (trained and cached on first use) playing
  its episodes (`modeling.episodes.play`; prompt 7 tokens, at most 20 after it);
- long: a GPT-2 of 4 x 256 with random weights, three policy turns of 24 tokens after a
  96-token prompt, 24 environment tokens between turns (a chat-length conversation).

Both ways sample the same tokens (checked). Writes bench/results/prefix_kv.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from bench.output import write_json
from rlhf_async.config import load_config
from rlhf_async.engines import Request
from rlhf_async.engines.torch.engine import TorchEngine
from rlhf_async.log import configure_logging
from rlhf_async.modeling.episodes import Episode, play
from rlhf_async.modeling.generation import SamplingParams, request_seed
from rlhf_async.task import make_task, sampling_params
from rlhf_async.task.artefacts import load_sft, prepare_artefacts

Turns = list[list[int]]  # every episode's tokens after its prompt
Workload = Callable[[TorchEngine], Awaitable[Turns]]


def calculator(args: argparse.Namespace) -> tuple[torch.nn.Module, SamplingParams, Workload, int]:
    cfg = load_config(None, ["task.name=calculator", f"run.cache_dir={args.cache_dir}"])
    task = make_task(cfg)
    policy = load_sft(prepare_artefacts(cfg, task).sft_dir).eval()
    params, spec = sampling_params(cfg, task), task.episode_spec()
    assert spec is not None
    chunks = [task.prompt_batch(cfg.run.seed, "train", k, args.prompts, 4)
              for k in range(args.chunks)]

    async def run(engine: TorchEngine) -> Turns:
        out: Turns = []
        for k, prompts in enumerate(chunks):
            async def turn(t: int, eps: list[Episode], sids: list[int], k: int = k,
                           ) -> list[tuple[list[int], list[float], bool]]:
                done = await asyncio.gather(*(engine.generate(Request(
                    f"{k}/{sid}/{t}", tuple(e.prompt + e.tokens),
                    min(params.max_new_tokens, spec.max_tokens - len(e.tokens)),
                    request_seed(cfg.run.seed, k, sid, turn=t), params.min_new_tokens,
                    cache_salt=f"sft:{k}")) for e, sid in zip(eps, sids, strict=True)))
                return [(c.token_ids, c.logprobs, c.finish == "stop") for c in done]
            out += [e.tokens for e in await play(prompts, params, spec, cfg.run.seed, k, turn)]
        return out
    return policy, params, run, args.chunks * args.prompts * 4


def long(args: argparse.Namespace) -> tuple[torch.nn.Module, SamplingParams, Workload, int]:
    torch.manual_seed(0)
    lm = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=512, n_embd=256, n_layer=4,
                                    n_head=4, bos_token_id=1, eos_token_id=2)).eval()
    params = SamplingParams(max_new_tokens=24, eos_id=512, pad_id=0)  # past the vocabulary
    n = args.chunks * args.prompts * 4
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (96,), generator=g).tolist() for _ in range(n)]
    env = torch.randint(3, 500, (24,), generator=g).tolist()

    async def episode(engine: TorchEngine, i: int) -> list[int]:
        conv = list(prompts[i])
        for t in range(3):
            got = await engine.generate(Request(f"{i}/{t}", tuple(conv), 24,
                                                request_seed(0, 0, i, turn=t), cache_salt="s"))
            conv += got.token_ids + (env if t < 2 else [])
        return conv[96:]

    async def run(engine: TorchEngine) -> Turns:
        out: Turns = []
        for c in range(args.chunks):  # a chunk's episodes at once, as a generator runs them
            rows = range(c * args.prompts * 4, (c + 1) * args.prompts * 4)
            out += await asyncio.gather(*(episode(engine, i) for i in rows))
        return out
    return lm, params, run, n


def measure(lm: torch.nn.Module, params: SamplingParams, run: Workload, episodes: int,
            repeats: int) -> dict:
    times: dict[int, list[float]] = {512: [], 0: []}
    tokens: dict[int, Turns] = {}
    hits = 0
    for r in range(repeats + 1):  # the first round warms up, untimed
        for mb in times:
            engine = TorchEngine.serving(lm, params, prefix_cache_mb=mb)

            async def go(engine: TorchEngine = engine) -> Turns:
                try:
                    return await run(engine)
                finally:
                    await engine.close()
            t0 = time.perf_counter()
            tokens[mb] = asyncio.run(go())
            if r:
                times[mb].append(time.perf_counter() - t0)
            hits = max(hits, engine.prefixes.hits)
    if tokens[512] != tokens[0]:
        raise SystemExit("kept KV changed the sampled tokens")
    eps = {mb: episodes / statistics.median(t) for mb, t in times.items()}
    return {"episodes": episodes, "episodes_per_s_kept": round(eps[512], 2),
            "episodes_per_s_full": round(eps[0], 2), "speedup": round(eps[512] / eps[0], 3),
            "turns_reusing_kv": hits, "seconds_kept": times[512], "seconds_full": times[0],
            "tokens_per_episode": round(sum(map(len, tokens[0])) / episodes, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.prefix_kv",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8, help="prompts a chunk (x 4 samples)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workload", nargs="+", default=["calculator", "long"],
                    choices=["calculator", "long"])
    ap.add_argument("--cache-dir", default="runs/cache", help="run.cache_dir (SFT policy)")
    ap.add_argument("--out", default="bench/results/prefix_kv.json")
    args = ap.parse_args(argv)
    configure_logging("warning")
    torch.set_num_threads(1)  # a generator node's share of a 2-core box
    load_start = os.getloadavg()
    results = {}
    for name in args.workload:
        lm, params, run, n = (calculator if name == "calculator" else long)(args)
        results[name] = measure(lm, params, run, n, args.repeats)
        sys.stdout.write(f"{name}: {json.dumps(results[name])}\n")
    results["load_average"] = {"start": load_start, "end": os.getloadavg()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(Path(args.out), results, indent=2)
    sys.stdout.write(f"load average {load_start} -> {os.getloadavg()}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
