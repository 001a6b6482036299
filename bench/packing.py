"""Training tokens/s of one `Learner.train_step` on a long-tail batch, three ways:

- rows:   `train.grad_accum` row micro-batches, each padded to the batch's widths (before
          `train.max_tokens_per_microbatch` existed);
- budget: token-budget micro-batches, longest rows together, each padded to its own
          widths (what a model that cannot pack gets);
- packed: token-budget micro-batches with each one's rows packed into one row.

    .venv/bin/python -m bench.packing [--rows 64] [--rounds 5] [--threads 1]

The batch: 90% of responses ~16 tokens (12-20), 10% ~128 (112-128), prompts 6-10 tokens,
groups of 4 responses per prompt (GRPO). Training tokens = the real prompt + response
tokens of the batch; padding is not counted. The modes take turns round by round (so
background load hits them alike); each number is the median over rounds of one step's
wall time. Models: the built-in task's default tiny GPT-2 shape (2 layers x 64 wide, 4
heads) and a bigger one (4 x 128, 4 heads), context 160. GRPO (actor only) and PPO (actor
and critic, one more no-grad forward for the old policy). The load average is printed
with the numbers; results go to bench/results/packing.json.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from bench.output import write_json
from rlhf_async.config import AlgoConfig, ModelConfig, TrainConfig
from rlhf_async.modeling.models import scalar_model_from_actor, tiny_config
from rlhf_async.modeling.rollout import RolloutBatch
from rlhf_async.rl.learner import Learner

VOCAB, PAD = 64, 0
SHAPES = {"2x64": (2, 64), "4x128": (4, 128)}


def long_tail_batch(rows: int, group: int = 4, seed: int = 0) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    n_prompts = rows // group
    plens = torch.randint(6, 11, (n_prompts,), generator=g).repeat_interleave(group)
    long = torch.rand(rows, generator=g) < 0.1
    rlens = torch.where(long, torch.randint(112, 129, (rows,), generator=g),
                        torch.randint(12, 21, (rows,), generator=g))
    P, R = int(plens.max()), int(rlens.max())
    prompt_ids = torch.full((rows, P), PAD)
    prompt_mask = torch.zeros(rows, P, dtype=torch.long)
    for k in range(n_prompts):
        p = int(plens[k * group])
        prompt_ids[k * group:(k + 1) * group, P - p:] = torch.randint(3, VOCAB, (p,),
                                                                      generator=g)
        prompt_mask[k * group:(k + 1) * group, P - p:] = 1
    response_ids = torch.full((rows, R), PAD)
    response_mask = torch.zeros(rows, R, dtype=torch.long)
    for i in range(rows):
        r = int(rlens[i])
        response_ids[i, :r] = torch.randint(3, VOCAB, (r,), generator=g)
        response_mask[i, :r] = 1
    m = response_mask.float()
    return RolloutBatch(prompt_ids, prompt_mask, response_ids, response_mask,
                        behaviour_logprobs=-3.0 * m, sample_ids=torch.arange(rows),
                        group_ids=torch.arange(rows) // group, step=0,
                        rewards=torch.randn(rows, generator=g), ref_logprobs=-3.1 * m)


def learners(shape: str, algo: str, micro_rows: int, budget: int) -> dict[str, Learner]:
    layers, hidden = SHAPES[shape]
    cfg = tiny_config(ModelConfig(hidden=hidden, layers=layers, heads=4, max_positions=160),
                      VOCAB, PAD, 1, 2)
    torch.manual_seed(0)
    actor = AutoModelForCausalLM.from_config(cfg)
    critic = scalar_model_from_actor(actor, 1) if algo == "ppo" else None
    a = AlgoConfig(name=algo)
    out = {}
    for mode in ("rows", "budget", "packed"):
        t = TrainConfig(epochs=1, minibatches=1, lr=1e-5, critic_lr=1e-5,
                        grad_accum=micro_rows if mode == "rows" else 1,
                        max_tokens_per_microbatch=0 if mode == "rows" else budget)
        out[mode] = Learner(copy.deepcopy(actor), copy.deepcopy(critic), a, t, seed=0)
    out["budget"].micro.packed = False  # the fallback of a model that cannot pack
    assert out["packed"].micro.packed, "this model should pack"
    return out


def run(shape: str, algo: str, rows: int, rounds: int) -> dict:
    b = long_tail_batch(rows)
    tokens = int(b.prompt_mask.sum() + (b.response_mask != 0).sum())
    width = b.prompt_ids.shape[1] + b.response_ids.shape[1]
    micro_rows = 4  # row micro-batches of rows / 4 each, padded to the batch's width
    budget = rows // micro_rows * width  # the same tokens per forward as one row micro-batch
    ls = learners(shape, algo, micro_rows, budget)
    for learner in ls.values():  # warm-up: allocator, attention registry, first-call paths
        learner.train_step(b)
    times: dict[str, list[float]] = {m: [] for m in ls}
    for _ in range(rounds):
        for mode, learner in ls.items():
            t0 = time.perf_counter()
            learner.train_step(b)
            times[mode].append(time.perf_counter() - t0)
    med = {m: statistics.median(v) for m, v in times.items()}
    return {"shape": shape, "algo": algo, "rows": rows, "train_tokens": tokens,
            "padded_cells": rows * width, "budget": budget, "grad_accum_rows": micro_rows,
            "seconds": med, "tokens_per_s": {m: tokens / s for m, s in med.items()},
            "packed_vs_rows": med["rows"] / med["packed"],
            "budget_vs_rows": med["rows"] / med["budget"],
            "packed_vs_budget": med["budget"] / med["packed"], "all_seconds": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--shapes", default="2x64,4x128")
    ap.add_argument("--algos", default="grpo,ppo")
    ap.add_argument("--out", default="bench/results/packing.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()
    results = []
    print(f"load average at start: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}; "
          f"threads {args.threads}")
    print("| model | algo | train tokens | rows tok/s | budget tok/s | packed tok/s | "
          "packed/rows | budget/rows | packed/budget |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for shape in args.shapes.split(","):
        for algo in args.algos.split(","):
            r = run(shape, algo, args.rows, args.rounds)
            results.append(r)
            tps = r["tokens_per_s"]
            print(f"| {shape} | {algo} | {r['train_tokens']} | {tps['rows']:,.0f} | "
                  f"{tps['budget']:,.0f} | {tps['packed']:,.0f} | {r['packed_vs_rows']:.2f} | "
                  f"{r['budget_vs_rows']:.2f} | {r['packed_vs_budget']:.2f} |", flush=True)
    load1 = os.getloadavg()
    print(f"load average at end: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(Path(args.out), {"load_start": load0, "load_end": load1,
                                "threads": args.threads, "results": results},
                               indent=1)


if __name__ == "__main__":
    main()
