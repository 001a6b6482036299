"""On-policy distillation vs RL on the learned reward model, on the built-in task: steps to
reach 90% of the teacher's hidden score.

    .venv/bin/python bench/distill_steps.py [--seeds 0 1] [--distill-steps 60] [override ...]

Per seed: the teacher is the default `rlhf-async run` (RL on the learned reward model, seed
s); its final hidden score on the held-out prompts is the teacher's score, and 90% of it the
target. RL's steps = the first step at which that same run's training curve (hidden score,
5-step moving average) reaches the target; distillation's = the same for a run from the same
SFT policy with `algo.name = distill` and `teacher.path` = the teacher's policy/. Prints the
table and the load average, writes bench/results/distill_steps.json (`--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, too
from bench.eval_seeds import smoothed
from bench.output import write_json
from rlhf_async.config import load_config
from rlhf_async.job import run
from rlhf_async.metrics import read_metrics

TARGET = 0.9


def steps_to(curve: list[float], target: float) -> int | None:
    """The first step (1-based) whose smoothed value reaches `target`; None: never."""
    return next((i + 1 for i, v in enumerate(smoothed(curve)) if v >= target), None)


def _curve(run_dir: Path) -> list[float]:
    return [r["hidden_score"] for r in read_metrics(run_dir / "metrics.jsonl")]


def one_seed(seed: int, distill_steps: int, stamp: str, overrides: list[str]) -> dict:
    rl = run(load_config(None, [f"run.seed={seed}", f"run.name=distill-rl-{seed}-{stamp}",
                                "run.plot=false", "run.progress=false", *overrides]))
    teacher = Path(rl["run_dir"]) / "policy"
    target = TARGET * rl["final_hidden_score"]
    dst = run(load_config(None, [f"run.seed={seed}", f"run.name=distill-{seed}-{stamp}",
                                 "algo.name=distill", f"teacher.path={json.dumps(str(teacher))}",
                                 f"train.steps={distill_steps}", "run.plot=false",
                                 "run.progress=false", *overrides]))
    return {"seed": seed, "sft": rl["sft_hidden_score"],
            "teacher": rl["final_hidden_score"], "target": target,
            "rl_steps": steps_to(_curve(Path(rl["run_dir"])), target),
            "distill_steps": steps_to(_curve(Path(dst["run_dir"])), target),
            "distill_final": dst["final_hidden_score"]}


def main() -> None:
    torch.set_num_threads(1)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--distill-steps", type=int, default=60)
    p.add_argument("--out", default="bench/results/distill_steps.json")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    stamp = time.strftime("%H%M%S")
    rows = [one_seed(s, a.distill_steps, stamp, a.overrides) for s in a.seeds]
    load = os.getloadavg()
    print(f"{'seed':>4} {'sft':>6} {'teacher':>7} {'target':>6} {'rl':>4} {'distill':>7} "
          f"{'distill final':>13}")
    for r in rows:
        print(f"{r['seed']:>4} {r['sft']:>6.3f} {r['teacher']:>7.3f} {r['target']:>6.3f} "
              f"{r['rl_steps']!s:>4} {r['distill_steps']!s:>7} {r['distill_final']:>13.3f}")
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (2 cores, shared)")
    write_json(Path(a.out), {"rows": rows, "load": load})


if __name__ == "__main__":
    main()
