"""Stops at random moments, each followed by `resume`, across the three strategies.

    .venv/bin/python bench/stop_resume.py [--runs 20] [--seed 0]

Run i uses Flattening, Interleaving or Separation in turn; at a random moment after the
job has started (0-12 s after it wrote its run directory: SFT included, to late in RL,
or after the end) it is stopped by SIGTERM or `rlhf-async stop`
(alternately), once, and `rlhf-async resume` is run until the run has finished. A run passes when both commands exit 0, the stop printed
the resume command, and at the end metrics.jsonl holds every step exactly once and (under
Separation) the trainer's log holds every sample exactly once. Prints one line a run and
the tally with the load average; writes bench/results/stop_resume.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench.output import write_json

STEPS = 40
BASE = ["model.hidden=32", "model.layers=1", "model.heads=2", "sft.steps=20",
        "reward_model.steps=20", "reward_model.heldout_pairs=64", "run.eval_prompts=16",
        f"train.steps={STEPS}", "train.prompts_per_step=4", "algo.group_size=2",
        "run.plot=false", "run.checkpoint_every=7", "placement.cpu_threads=1",
        "placement.devices=2"]
STRATEGIES = ("flattening", "interleaving", "separation")


def _cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rlhf_async", *args], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _steps(path: Path) -> list[int]:
    return [json.loads(x)["step"] for x in path.read_text().splitlines()] \
        if path.exists() else []


def one(i: int, strategy: str, how: str, delay: float, root: Path) -> dict:
    run_dir = root / f"r{i}"
    proc = _cli("run", *BASE, f"placement.strategy={strategy}", f"run.name=r{i}",
                f"run.output_dir={json.dumps(str(root))}",
                f"run.cache_dir={json.dumps(str(root / 'cache'))}")
    deadline = time.monotonic() + 120  # the moment counts from the job's start
    while not (run_dir / "config.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(delay)
    stopped_at = len(_steps(run_dir / "metrics.jsonl"))
    if proc.poll() is None:
        if how == "SIGTERM":
            proc.send_signal(signal.SIGTERM)
        else:
            subprocess.run([sys.executable, "-m", "rlhf_async", "stop", "--run-dir",
                            str(run_dir)], capture_output=True, timeout=60)
    out, _ = proc.communicate(timeout=300)
    ok = proc.returncode == 0 and ("continue with: rlhf-async resume" in out or
                                   "policy:" in out)
    resumes = 0
    while ok and not (run_dir / "summary.json").exists() and resumes < 3:
        r = _cli("resume", str(run_dir))
        rout, _ = r.communicate(timeout=300)
        ok = r.returncode == 0
        out += rout
        resumes += 1
    steps = _steps(run_dir / "metrics.jsonl")
    ok = ok and steps == list(range(STEPS))
    if strategy == "separation" and ok:
        counts = Counter(s for x in (run_dir / "trained_samples.jsonl").read_text().splitlines()
                         for s in json.loads(x)["sample_ids"])
        ok = set(counts) == set(range(STEPS * 8)) and set(counts.values()) == {1}
    return {"run": i, "strategy": strategy, "how": how, "delay_s": round(delay, 2),
            "steps_at_stop": stopped_at, "resumes": resumes, "ok": ok,
            "tail": "" if ok else out[-1500:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/stop_resume.json")
    args = ap.parse_args()
    rng, load0 = random.Random(args.seed), os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="stop-resume-") as d:
        for i in range(args.runs):
            strategy = STRATEGIES[i % len(STRATEGIES)]
            how = "SIGTERM" if i % 2 == 0 else "stop"
            row = one(i, strategy, how, rng.uniform(0.0, 12.0), Path(d))
            rows.append(row)
            print(f"run {i:2d} {strategy:12s} {how:7s} after {row['delay_s']:5.2f}s "
                  f"(step {row['steps_at_stop']:2d}), resumes {row['resumes']}: "
                  f"{'ok' if row['ok'] else 'FAILED'}", flush=True)
            if not row["ok"]:
                print(row["tail"], flush=True)
    good = sum(r["ok"] for r in rows)
    load1 = os.getloadavg()
    print(f"{good} of {len(rows)} runs finished with every step and sample exactly once; "
          f"load average {load0[0]:.1f} -> {load1[0]:.1f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(Path(args.out), {"rows": rows, "load": [load0[0], load1[0]]},
                               indent=1)
    return 0 if good == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
