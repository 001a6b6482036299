"""Does asynchronous generation still learn? Separation at max_staleness 0, 1, 2 (and
optionally with truncated importance sampling) on the built-in task, same seeds.

    python bench/staleness_quality.py [--seeds 0 1 2] [--is-cap 2.0] [key=value ...]

Prints the final hidden score of each run on the held-out prompts and each k's mean as a
fraction of the synchronous run's; writes bench/results/staleness_quality.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from bench.output import write_json
from rlhf_async import job
from rlhf_async.config import load_config
from rlhf_async.log import configure_logging


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--is-cap", type=float, default=0.0,
                    help="truncated importance sampling (algo.mismatch = tis) with this cap "
                         "for k > 0 runs")
    ap.add_argument("--out", default="bench/results/staleness_quality.json")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    configure_logging("warning")
    rows = []
    for seed in args.seeds:
        for k in args.staleness:
            over = ["placement.strategy=separation", "placement.devices=2",
                    f"algo.max_staleness={k}", f"run.seed={seed}", "run.progress=false",
                    "run.plot=false", "run.output_dir=runs/bench-staleness",
                    f"run.name=k{k}-s{seed}-{int(time.time())}", *args.overrides]
            if k > 0 and args.is_cap:
                over += ["algo.mismatch=tis", f"algo.mismatch_cap={args.is_cap}"]
            s = job.run(load_config(None, over))
            rows.append({"seed": seed, "k": k, "sft": s["sft_hidden_score"],
                         "final": s["final_hidden_score"], "rl_seconds": s["rl_seconds"],
                         "samples_per_s": s["rl_samples_per_s"]})
            print(f"seed {seed} k={k}: SFT {s['sft_hidden_score']:.3f} -> final "
                  f"{s['final_hidden_score']:.3f} ({s['rl_seconds']:.0f}s RL)", file=sys.stderr)
    by_k = {k: statistics.mean(r["final"] for r in rows if r["k"] == k) for k in args.staleness}
    base = by_k.get(0)
    print(f"\n{'k':>3} {'mean final hidden':>18} {'vs k=0':>8}")
    for k, v in by_k.items():
        print(f"{k:>3} {v:18.3f} {v / base:8.3f}" if base else f"{k:>3} {v:18.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, {"rows": rows, "mean_final_by_k": by_k,
                     "is_cap": args.is_cap, "overrides": args.overrides}, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
