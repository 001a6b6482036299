"""SFT vs final hidden score for PPO and GRPO over several seeds (the acceptance table).

    .venv/bin/python bench/eval_seeds.py [--seeds 0 1 2] [--algos ppo grpo] [override ...]

Each seed trains (or reuses from the cache) its own SFT policy and reward model; every run
is the default `rlhf-async run` job with `algo.name` and `run.seed` set. Prints a table and
writes bench/results/eval_seeds.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from rlhf_async.config import load_config
from rlhf_async.job import run

COLUMNS = ("algo", "seed", "sft_hidden_score", "final_hidden_score", "sft_reward",
           "final_reward", "rm_accuracy", "pretrain_seconds", "rl_seconds", "rl_samples_per_s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--algos", nargs="+", default=["ppo", "grpo"])
    ap.add_argument("--out", default="bench/results/eval_seeds.json")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. train.steps=50")
    args = ap.parse_args()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    rows = []
    for seed in args.seeds:
        for algo in args.algos:
            cfg = load_config(None, [f"algo.name={algo}", f"run.seed={seed}",
                                     f"run.name=eval-{stamp}-{algo}-s{seed}",
                                     "run.progress=false", *args.overrides])
            s = run(cfg)
            rows.append({k: s[k] for k in COLUMNS})
            print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in rows[-1].items()), file=sys.stderr, flush=True)
    print(f"\n{'algo':5} {'seed':>4} {'SFT hidden':>10} {'final hidden':>12} {'RM acc':>7} "
          f"{'pre s':>6} {'RL s':>6} {'smp/s':>6}")
    for r in rows:
        print(f"{r['algo']:5} {r['seed']:>4} {r['sft_hidden_score']:>10.3f} "
              f"{r['final_hidden_score']:>12.3f} {r['rm_accuracy']:>7.3f} "
              f"{r['pretrain_seconds']:>6.1f} {r['rl_seconds']:>6.1f} "
              f"{r['rl_samples_per_s']:>6.0f}")
    for algo in args.algos:
        sel = [r for r in rows if r["algo"] == algo]
        gain = [r["final_hidden_score"] - r["sft_hidden_score"] for r in sel]
        sd = statistics.stdev(gain) if len(gain) > 1 else 0.0
        print(f"{algo}: mean SFT {statistics.mean(r['sft_hidden_score'] for r in sel):.3f} -> "
              f"final {statistics.mean(r['final_hidden_score'] for r in sel):.3f} "
              f"(gain {statistics.mean(gain):+.3f} +- {sd:.3f} over {len(sel)} seeds)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"overrides": args.overrides, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
