"""Every strategy under sustained load, then (with the `bench` extra) TRL side by side.

    .venv/bin/python -m bench run strategies [--quick] [--steps 30] [--size 4x128]
        [--prompts 32] [--generators 1] [--scorers 1] [--no-trl] [key=value ...]

Each strategy runs the built-in job's RL phase (`job.run`, SFT and reward model from the
shared cache) on every core, with its per-step progress line on stderr. From each run's
metrics.jsonl: samples/s and completion tokens/s over the steady steps (warm-up excluded),
per-stage utilisation, queue depths, staleness, weight-sync time and hidden score against
wall-clock. Writes bench/results/bench.json and bench/results/bench.png, prints a table,
then runs `bench.trl_compare` with the same model, batch and steps (unless --no-trl or trl
is not installed). `--quick`: the built-in 2x64 model, 8 steps, two strategies.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

from bench import trl_compare
from bench.bench_pipeline import steady
from bench.output import write_json
from bench.plots import plot_runs
from bench.trl_rows import SIZES
from rlhf_async import job
from rlhf_async.config import JobConfig, load_config
from rlhf_async.log import configure_logging
from rlhf_async.metrics import read_metrics

VARIANTS = {
    "flattening": ["placement.strategy=flattening"],
    "interleaving": ["placement.strategy=interleaving"],
    "separation k=0": ["placement.strategy=separation", "algo.max_staleness=0"],
    "separation k=1": ["placement.strategy=separation", "algo.max_staleness=1"],
}
QUICK = ("flattening", "separation k=1")


def series(records: list[dict]) -> dict[str, list[float]]:
    """Per-step time series against cumulative wall-clock of the RL phase."""
    out: dict[str, list[float]] = {k: [] for k in ("t", "samples_per_s", "tokens_per_s",
                                                   "hidden_score")}
    t = 0.0
    for r in records:
        dt = r.get("time_step") or r["time_generate"] + r["time_score"] + r["time_train"]
        t += dt
        out["t"].append(t)
        out["samples_per_s"].append(r["samples"] / dt)
        out["tokens_per_s"].append(r["samples"] * r["response_length"] / dt)
        out["hidden_score"].append(r["hidden_score"])
        if "weight_sync_s" in r:
            out.setdefault("weight_sync_s", []).append(r["weight_sync_s"])
            out.setdefault("staleness", []).append(r.get("staleness/mean", 0.0))
            out.setdefault("queue_depth", []).append(
                sum(v for k, v in r.items() if k.startswith("queue/")))
    return out


def mfu_means(rows: list[dict]) -> dict[str, float]:
    """Each `mfu/*` over the steady steps, weighted by step time (FLOPs over device time)."""
    keys = sorted({k for r in rows for k in r if k.startswith("mfu/")})
    wall = sum(r["time_step"] for r in rows) or 1.0
    return {k.removeprefix("mfu/"): sum(r.get(k, 0.0) * r["time_step"] for r in rows) / wall
            for k in keys}


def measured_run(cfg: JobConfig, warmup: int, bench: str = "bench") -> tuple[dict, list[dict]]:
    """Run one job and measure its steady steps (after `warmup`): (the measures, the
    job's metrics records), shared by this benchmark and bench/longtail.py."""
    s = job.run(cfg)
    recs = read_metrics(Path(s["run_dir"]) / "metrics.jsonl")
    if len(recs) <= warmup:
        raise SystemExit(f"{bench}: --steps must exceed --warmup ({warmup})")
    st = steady(recs, warmup)
    tokens = sum(r["samples"] * r["response_length"] for r in recs[warmup:])
    return {**st, "tokens_per_s": tokens / st["wall_s"], "series": series(recs),
            "mfu": mfu_means(recs[warmup:]),
            "run_dir": s["run_dir"], "rl_wall_s": s["rl_seconds"],
            "sft_hidden_score": s["sft_hidden_score"],
            "final_hidden_score": s["final_hidden_score"],
            "response_length": tokens / sum(r["samples"] for r in recs[warmup:])}, recs


def run_variant(name: str, base: list[str], warmup: int) -> dict:
    tag = name.replace(" ", "").replace("=", "")
    cfg = load_config(None, base + VARIANTS[name] + [f"run.name={tag}-{time.time_ns()}"])
    return measured_run(cfg, warmup)[0]


def print_table(results: dict[str, dict]) -> None:
    flat = results.get("flattening", {}).get("samples_per_s")
    print(f"\n{'strategy':16s} {'samples/s':>9s} {'tokens/s':>9s} {'vs flat':>7s} "
          f"{'RL wall s':>9s} {'hidden SFT->final':>18s}  {'MFU':>5s}  utilisation  "
          "(MFU per stage)")
    for name, r in results.items():
        vs = f"{r['samples_per_s'] / flat:.2f}x" if flat else "-"
        util = " ".join(f"{k}={v:.2f}" for k, v in r["utilisation"].items())
        mfu = r.get("mfu", {})
        stages = " ".join(f"{k}={v:.1%}" for k, v in mfu.items() if k != "step")
        step = f"{mfu['step']:.1%}" if "step" in mfu else "-"
        print(f"{name:16s} {r['samples_per_s']:9.1f} {r['tokens_per_s']:9.0f} {vs:>7s} "
              f"{r['rl_wall_s']:9.1f} {r['sft_hidden_score']:8.3f} -> "
              f"{r['final_hidden_score']:.3f}  {step:>5s}  {util}  ({stages})")


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench run strategies", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2x64 model, 8 steps, 2 strategies")
    ap.add_argument("--steps", type=int, default=30, help="RL steps per strategy")
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out")
    ap.add_argument("--size", default="4x128", choices=list(SIZES),
                    help="layers x width of the tiny GPT-2")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step")
    ap.add_argument("--group", type=int, default=4, help="responses per prompt")
    ap.add_argument("--generators", type=int, default=1, help="generator replicas (separation)")
    ap.add_argument("--scorers", type=int, default=1, help="scorer replicas (separation)")
    ap.add_argument("--only", nargs="*", default=None, choices=list(VARIANTS))
    ap.add_argument("--no-trl", action="store_true", help="skip the TRL comparison")
    ap.add_argument("--out", default="bench/results/bench.json")
    ap.add_argument("overrides", nargs="*", help="config overrides for every strategy")
    args = ap.parse_args(argv)
    if args.quick:
        args.size, args.steps = "2x64", min(args.steps, 8)
        args.only = args.only or list(QUICK)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    configure_logging("warning")
    cores = os.cpu_count() or 1
    layers, hidden, heads = SIZES[args.size]
    base = [f"model.layers={layers}", f"model.hidden={hidden}", f"model.heads={heads}",
            "algo.name=grpo", f"algo.group_size={args.group}", f"train.steps={args.steps}",
            f"train.prompts_per_step={args.prompts}", f"placement.devices={cores}",
            f"placement.generators={args.generators}", f"placement.scorers={args.scorers}",
            "run.plot=false", "run.eval_prompts=64", "run.checkpoint_every=0",
            "run.output_dir=runs/bench", *args.overrides]
    load_config(None, base)  # bad overrides fail here, before any run starts
    names = [n for n in VARIANTS if not args.only or n in args.only]
    results: dict[str, dict] = {}
    for i, name in enumerate(names):
        print(f"== {i + 1}/{len(names)}: {name} ({args.size}, {args.steps} steps)",
              file=sys.stderr, flush=True)
        results[name] = run_variant(name, base, args.warmup)
    print_table(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = plot_runs(results, out.with_suffix(".png"), f"GRPO, {args.size} GPT-2, {cores} cores")
    load = os.getloadavg()
    write_json(out, {"args": vars(args), "cores": cores, "loadavg": load, "results": results},
               indent=2)
    print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; wrote {out} and {png}")
    if args.no_trl or importlib.util.find_spec("trl") is None:
        return 0
    return trl_compare.main(["--size", args.size, "--steps", str(args.steps),
                             "--warmup", str(args.warmup), "--prompts", str(args.prompts),
                             "--group", str(args.group),
                             "--out", str(out.with_name("trl_compare.json")), *args.overrides])


if __name__ == "__main__":
    sys.exit(main())
