"""Long-tailed response lengths: Flattening, Separation k=1, and Separation k=1 with partial
rollouts (and token-budget micro-batches), side by side in one run.

    python -m bench.longtail [--quick] [--steps 60] [--rounds 3] [--size 2x64] [key=value ...]

The task is the built-in sort_digits with a long tail of prompt lengths (`task.long_fraction`):
90% of prompts hold 3-4 digits, 10% hold 5-32, and the correct answer is as long as its prompt
(the hidden score counts the digits kept, times the share in order), so a batch of 64 rows
almost always holds a few answers ~8x longer than the rest: the rows that finish early wait
for them. Every row runs the same job (GRPO, one epoch and one minibatch per batch, so
generation is a large share of a step), the same steps and batch, so every row trains the
same number of samples; the hidden score on the held-out prompts after the run compares
quality at equal samples.

Rows whose config key does not exist in this tree (`generation.partial_rollout`,
`train.max_tokens_per_microbatch`: other branches) are printed as "not available" and not
run. Reported per row: samples/s and completion tokens/s over the steady steps, the
generator's idle share (Separation: 1 - the generator nodes' busy / wall; Flattening: the
share of a step its processes are not generating), the held-out hidden score after SFT and
after RL (and split into short and long prompts), the responses that partial rollouts cut
across weight versions (`partial/interrupted_rows` of the step records, "-" where a row's
records do not count them), and the load average before and after. With --rounds N the rows take turns N
times (the order reversed every other round, so background load hits them alike) and each
row reports its median round by samples/s, with every round's rate beside it. Writes
bench/results/longtail.json (`--out`) and each row's per-step series to
runs/longtail_series.json (`--series-out`).

Scaling the generation-bound job (`--tail long`) while it runs: bench/elastic.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.output import traces_path, write_json
from bench.strategies import measured_run
from bench.trl_rows import SIZES
from rlhf_async.config import JobConfig, load_config
from rlhf_async.log import configure_logging
from rlhf_async.modeling.episodes import rollout
from rlhf_async.task import SortDigitsTask, sampling_params
from rlhf_async.task.artefacts import load_sft, prepare_artefacts
from rlhf_async.task.evaluation import EVAL_STEP

TAILS = {
    # 90% of prompts 3-4 digits, 10% 5-32: answers of 4-5 tokens, a tail up to 33 (EOS in)
    "short": ["task.min_len=3", "task.short_len=4", "task.max_len=32",
              "task.long_fraction=0.1", "generation.max_new_tokens=36",
              "model.max_positions=80"],
    # 90% 3-6 digits, 10% 7-96: a tail up to 97 tokens, ~20x the short answers; a chunk's
    # generation is its longest answer's 97 decode steps, so the generator bounds the step
    "long": ["task.min_len=3", "task.short_len=6", "task.max_len=96",
             "task.long_fraction=0.1", "generation.max_new_tokens=100",
             "model.max_positions=208"],
}
SEP1 = ["placement.strategy=separation", "algo.max_staleness=1"]
SEP2 = ["placement.strategy=separation", "algo.max_staleness=2"]
CONTINUOUS = ["generation.partial_rollout=true", "generation.continuous_batching=true",
              "train.max_tokens_per_microbatch={max_tokens}"]
# row -> (overrides, the config keys it needs: (section, key))
ROWS: dict[str, tuple[list[str], list[tuple[str, str]]]] = {
    "flattening (sync)": (["placement.strategy=flattening"], []),
    "flattening packed": (["placement.strategy=flattening",
                           "train.max_tokens_per_microbatch={max_tokens}"],
                          [("train", "max_tokens_per_microbatch")]),
    "separation k=1": (SEP1, []),
    "separation k=1 partial": ([*SEP1, "generation.partial_rollout=true"],
                               [("generation", "partial_rollout")]),
    "separation k=1 packed": ([*SEP1, "train.max_tokens_per_microbatch={max_tokens}"],
                              [("train", "max_tokens_per_microbatch")]),
    # everything issue 35 adds: in-flight weights, continuous batching, packed training
    "separation k=1 continuous": ([*SEP1, *CONTINUOUS],
                                  [("generation", "continuous_batching")]),
    # a chunk more in flight: what continuous batching can fill its slots from
    "separation k=2 packed": ([*SEP2, "train.max_tokens_per_microbatch={max_tokens}"],
                              [("train", "max_tokens_per_microbatch")]),
    "separation k=2 continuous": ([*SEP2, *CONTINUOUS],
                                  [("generation", "continuous_batching")]),
}


# what each round of a row keeps beside its median round
ROUND_KEYS = ("samples_per_s", "tokens_per_s", "generator_idle", "final_hidden_score",
              "hidden_long", "interrupted_rows", "loadavg_before", "loadavg_after")


def has_key(section: str, key: str) -> bool:
    """Whether this tree's config schema has `section.key`."""
    return key in {f.name for f in dataclasses.fields(getattr(JobConfig(), section))}


def missing_keys(row: str) -> list[str]:
    """The config keys `row` needs that this tree does not have."""
    return [f"{s}.{k}" for s, k in ROWS[row][1] if not has_key(s, k)]


def generator_idle(util: dict[str, float]) -> float:
    """Share of the wall time the generator is not generating: Separation's generator nodes
    ("gen" role: 1 - busy / wall), or Flattening's processes (1 - the generate phase's
    share of the step)."""
    if "generate" in util:
        return 1.0 - util["generate"]
    gen = [v for role, v in util.items() if role.startswith("gen")]
    if not gen:
        raise KeyError(f"no generator in the utilisation {sorted(util)}")
    return 1.0 - max(gen)


@torch.no_grad()
def tail_scores(cfg: JobConfig, policy_dir: Path) -> dict[str, float]:
    """The held-out hidden score split at task.short_len: the same prompts and sampling
    noise as the job's own evaluation (`evaluate`), so "long" is the quality on the tail,
    which a policy that learned to stop short would lose."""
    task = SortDigitsTask(cfg.task)
    prompts = task.prompt_batch(cfg.run.seed, "eval", 0, cfg.run.eval_prompts, 1)
    b = rollout(load_sft(policy_dir), prompts, sampling_params(cfg, task), cfg.run.seed,
                EVAL_STEP, 0)
    hidden = task.hidden_scores(b.prompt_ids, b.response_ids, b.response_mask)  # [B]
    long = b.prompt_mask.sum(1) - 2 > cfg.task.short_len  # [B] (BOS digits SEP)
    return {"hidden_long": float(hidden[long].mean()), "hidden_short": float(hidden[~long].mean()),
            "long_prompts": int(long.sum()),
            "response_length_long": float(b.response_mask[long].sum(1).float().mean())}


def interrupted_rows(records: list[dict]) -> float | None:
    """Responses whose tokens came from more than one weight version (what partial rollouts
    do: `partial/interrupted_rows` in a step record); None where no record counts them."""
    counts = [r["partial/interrupted_rows"] for r in records if "partial/interrupted_rows" in r]
    return sum(counts) if counts else None


def run_row(name: str, base: list[str], warmup: int, max_tokens: int) -> dict:
    over = row_overrides(name, max_tokens)
    tag = name.replace(" ", "").replace("=", "").replace("(", "").replace(")", "")
    cfg = load_config(None, [*base, *over, f"run.name={tag}-{time.time_ns()}"])
    load_before = os.getloadavg()
    out, recs = measured_run(cfg, warmup, "longtail")
    return {**out, "generator_idle": generator_idle(out["utilisation"]),
            "trained_samples": sum(r["samples"] for r in recs),
            "interrupted_rows": interrupted_rows(recs),
            "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
            **tail_scores(cfg, Path(out["run_dir"]) / "policy")}


def print_table(results: dict[str, dict]) -> None:
    flat = results.get("flattening (sync)", {}).get("samples_per_s")
    sep = results.get("separation k=1", {}).get("samples_per_s")
    print(f"\n{'row':24s} {'samples/s':>9s} {'tokens/s':>9s} {'vs flat':>7s} {'vs k=1':>7s} "
          f"{'gen idle':>8s} {'len':>5s} {'samples':>7s} {'hidden SFT->RL':>15s} "
          f"{'short':>6s} {'long':>6s} {'interr.':>7s} {'load':>10s}")
    for name, r in results.items():
        if "unavailable" in r:
            print(f"{name:24s} not available: {r['unavailable']}")
            continue
        vf = f"{r['samples_per_s'] / flat:.2f}x" if flat else "-"
        vk = f"{r['samples_per_s'] / sep:.2f}x" if sep else "-"
        load = f"{r['loadavg_before'][0]:.1f}->{r['loadavg_after'][0]:.1f}"
        cut = "-" if r["interrupted_rows"] is None else f"{r['interrupted_rows']:.0f}"
        print(f"{name:24s} {r['samples_per_s']:9.1f} {r['tokens_per_s']:9.0f} {vf:>7s} {vk:>7s} "
              f"{r['generator_idle']:8.2f} {r['response_length']:5.1f} "
              f"{r['trained_samples']:7.0f} {r['sft_hidden_score']:6.3f} -> "
              f"{r['final_hidden_score']:.3f} {r['hidden_short']:6.3f} {r['hidden_long']:6.3f} "
              f"{cut:>7s} {load:>10s}")
    for name, r in results.items():
        if len(r.get("rounds", [])) > 1:
            rates = " / ".join(f"{x['samples_per_s']:.0f}" for x in r["rounds"])
            hidden = " / ".join(f"{x['final_hidden_score']:.3f}" for x in r["rounds"])
            print(f"  {name}: samples/s by round {rates}; hidden after RL {hidden}")


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.longtail",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="10 steps of 8 prompts x 4, 64 held-out prompts (< 3 min with the SFT "
                    "policy and reward model cached)")
    ap.add_argument("--steps", type=int, default=60, help="RL steps per row")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rows take turns this many times; each reports its median round")
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out of the rates")
    ap.add_argument("--size", default="2x64", choices=list(SIZES),
                    help="layers x width of the tiny GPT-2")
    ap.add_argument("--tail", default="short", choices=list(TAILS),
                    help="the length distribution: short (answers 4-5 tokens, tail to 33) or "
                    "long (3-7 tokens, tail to 97: generation-bound)")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step")
    ap.add_argument("--group", type=int, default=4, help="responses per prompt")
    ap.add_argument("--max-tokens", type=int, default=1024,
                    help="train.max_tokens_per_microbatch of the packed row")
    ap.add_argument("--eval-prompts", type=int, default=512,
                    help="held-out prompts (~10%% of them long)")
    ap.add_argument("--only", nargs="*", default=None, choices=list(ROWS))
    ap.add_argument("--out", default="bench/results/longtail.json")
    ap.add_argument("--series-out", help="each row's per-step series; default "
                    "runs/<--out's name>_series.json")
    ap.add_argument("overrides", nargs="*", help="config overrides for every row")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.prompts, args.eval_prompts, args.rounds = min(args.steps, 10), 8, 64, 1
    return args


def write_results(out: Path, series_out: Path, results: dict[str, dict],
                  head: dict[str, Any]) -> None:
    """Each row's numbers to `out`, its per-step series (most of the bytes) to `series_out`."""
    rows = {n: {k: v for k, v in r.items() if k != "series"} for n, r in results.items()}
    write_json(out, {**head, "results": rows}, indent=2)
    write_json(series_out, {**head, "series": {n: r.get("series", {}) for n, r in results.items()}})


def base_overrides(args: argparse.Namespace, cores: int) -> list[str]:
    """What every row shares: the long-tail task, the model, the GRPO job, the batch."""
    layers, hidden, heads = SIZES[args.size]
    return [f"model.layers={layers}", f"model.hidden={hidden}", f"model.heads={heads}", *TAILS[args.tail],
            "algo.name=grpo", f"algo.group_size={args.group}", "train.epochs=1",
            "train.minibatches=1", f"train.steps={args.steps}",
            f"train.prompts_per_step={args.prompts}", f"placement.devices={cores}",
            "run.plot=false", f"run.eval_prompts={args.eval_prompts}", "run.checkpoint_every=0",
            "run.output_dir=runs/bench-longtail", *args.overrides]


def row_overrides(name: str, max_tokens: int) -> list[str]:
    return [o.format(max_tokens=max_tokens) for o in ROWS[name][0]]


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    configure_logging("warning")
    cores = os.cpu_count() or 1
    base = base_overrides(args, cores)
    load_config(None, base)  # bad overrides fail here, before any run starts
    names = [n for n in ROWS if not args.only or n in args.only]
    load_start = os.getloadavg()
    print(f"load average at start {load_start[0]:.1f} {load_start[1]:.1f} {load_start[2]:.1f}",
          file=sys.stderr)
    results: dict[str, dict] = {}
    runnable = []
    for name in names:
        missing = missing_keys(name)
        if missing:
            results[name] = {"unavailable": f"{', '.join(missing)} is not in this tree's "
                             "config schema"}
            print(f"== {name}: not available ({', '.join(missing)})", file=sys.stderr)
        else:
            runnable.append(name)
    rounds: dict[str, list[dict]] = {n: [] for n in runnable}
    for r in range(args.rounds):
        for name in runnable if r % 2 == 0 else runnable[::-1]:
            print(f"== round {r + 1}/{args.rounds}: {name} ({args.size}, {args.steps} steps)",
                  file=sys.stderr, flush=True)
            rounds[name].append(run_row(name, base, args.warmup, args.max_tokens))
    for name, runs in rounds.items():
        median = sorted(runs, key=lambda x: x["samples_per_s"])[len(runs) // 2]
        results[name] = {**median, "rounds": [{k: x[k] for k in ROUND_KEYS} for x in runs]}
    results = {n: results[n] for n in names}
    print_table(results)
    cfg = load_config(None, base)
    sft = tail_scores(cfg, prepare_artefacts(cfg, SortDigitsTask(cfg.task)).sft_dir)
    print(f"SFT policy (where every row starts): hidden short {sft['hidden_short']:.3f}, long "
          f"{sft['hidden_long']:.3f} ({sft['long_prompts']} long of {args.eval_prompts} "
          "held-out prompts)")
    load = os.getloadavg()
    out = Path(args.out)
    series_out = traces_path(out, args.series_out, "series")
    write_results(out, series_out, results, {
        "args": vars(args), "cores": cores, "overrides": base, "loadavg_start": load_start,
        "loadavg_end": load, "sft": sft})
    print(f"load average {load_start[0]:.1f} at start, {load[0]:.1f} {load[1]:.1f} "
          f"{load[2]:.1f} at end; wrote {out} and {series_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
