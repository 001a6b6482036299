"""Flattening vs Separation (max_staleness 0, 1, 2) side by side, same model and batch.

    python bench/bench_pipeline.py [--steps 12] [--warmup 2] [key=value ...]

Each variant runs the built-in task's RL phase (SFT and reward model come from the shared
cache) on every core of this machine: Flattening as one process per core, Separation as
trainer | generator + scorer. Reports steady-state samples/s (warm-up steps excluded),
per-stage utilisation (busy time / wall time), and overlap efficiency: the slowest stage's
busy time / step time (1.0 = the pipeline runs at the speed of its slowest stage). Writes
JSON to bench/results/pipeline.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from rlhf_async import job
from rlhf_async.config import load_config
from rlhf_async.log import configure_logging
from rlhf_async.metrics import read_metrics

VARIANTS = {
    "flattening": ["placement.strategy=flattening"],
    "separation k=0": ["placement.strategy=separation", "algo.max_staleness=0"],
    "separation k=1": ["placement.strategy=separation", "algo.max_staleness=1"],
    "separation k=2": ["placement.strategy=separation", "algo.max_staleness=2"],
}


def steady(records: list[dict], warmup: int) -> dict:
    rows = records[warmup:]
    if "time_step" in rows[0]:  # separation: wall time between trained steps
        wall = sum(r["time_step"] for r in rows)
        stages: dict[str, float] = {}
        for r in rows:
            for k, v in r.items():
                if k.startswith("util/"):
                    stages[k[5:]] = stages.get(k[5:], 0.0) + v * r["time_step"]
        # a stage = a role; replicas of a role share its work
        roles: dict[str, float] = {}
        for node, busy in stages.items():
            role = node.rstrip("0123456789")
            roles[role] = max(roles.get(role, 0.0), busy)
        slowest = max(roles.values()) if roles else 0.0
        util = {k: v / wall for k, v in roles.items()}
        overlap = slowest / wall
    else:  # flattening: generate -> score -> train in lock-step on every process
        wall = sum(r["time_generate"] + r["time_score"] + r["time_train"] for r in rows)
        util = {p: sum(r[f"time_{p}"] for r in rows) / wall
                for p in ("generate", "score", "train")}
        overlap = None
    samples = sum(r["samples"] for r in rows)
    return {"samples_per_s": samples / wall, "wall_s": wall, "steps": len(rows),
            "utilisation": util, "overlap_efficiency": overlap}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default="bench/results/pipeline.json")
    ap.add_argument("--only", nargs="*", default=None, help="variant names to run")
    ap.add_argument("overrides", nargs="*", help="config overrides for every variant")
    args = ap.parse_args(argv)
    configure_logging("warning")
    devices = os.cpu_count() or 1
    base = [f"train.steps={args.steps}", "run.progress=false", "run.plot=false",
            f"placement.devices={devices}", "run.output_dir=runs/bench-pipeline",
            "run.eval_prompts=64", *args.overrides]
    results = {}
    for name, extra in VARIANTS.items():
        if args.only and name not in args.only:
            continue
        tag = name.replace(" ", "").replace("=", "")
        cfg = load_config(None, base + extra + [f"run.name={tag}-{int(time.time())}"])
        summary = job.run(cfg)
        records = read_metrics(Path(summary["run_dir"]) / "metrics.jsonl")
        results[name] = {**steady(records, args.warmup),
                         "final_hidden_score": summary["final_hidden_score"]}
        print(f"{name:16s} {results[name]['samples_per_s']:8.1f} samples/s", file=sys.stderr)
    k0 = results.get("separation k=0", {}).get("samples_per_s")
    flat = results.get("flattening", {}).get("samples_per_s")
    print(f"\n{'variant':16s} {'samples/s':>10s} {'vs k=0':>7s} {'vs flat':>8s} "
          f"{'overlap':>8s}  utilisation")
    for name, r in results.items():
        util = " ".join(f"{k}={v:.2f}" for k, v in r["utilisation"].items())
        ov = "-" if r["overlap_efficiency"] is None else f"{r['overlap_efficiency']:.2f}"
        vs0 = f"{r['samples_per_s'] / k0:.2f}x" if k0 else "-"
        vsf = f"{r['samples_per_s'] / flat:.2f}x" if flat else "-"
        print(f"{name:16s} {r['samples_per_s']:10.1f} {vs0:>7s} {vsf:>8s} {ov:>8s}  {util}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"devices": devices, "steps": args.steps, "warmup": args.warmup,
                               "overrides": args.overrides, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
