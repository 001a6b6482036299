"""Elastic Separation, measured in one command: scaling a running job, and online
rebalancing against the best static split (issue 45's two measured acceptance lines).

    python -m bench.elastic --out bench/results/elastic_16core.json   # 16 cores: <= 6 min
    python -m bench.elastic --quick                                    # the mechanics, tiny

1. scale: the long-tail bench's generation-bound job (`bench.longtail --tail long`: 10% of
   answers ~20x the rest, GRPO, packed training), Separation k=1 with the trainer, one
   generator and one scorer on devices of their own and one device free. Once it is
   steady it is scaled to two generators (`rlhf-async scale`'s request), and once the new
   generator has worked a few steps, back to one; then stopped. Samples/s before, with
   two, and after the scale down, from the same run's step records; "no loss": every step
   trained once and every prompt of them exactly once, no restart counted.
2. rebalance, on two jobs of different shape: `generation-bound` (as above) and
   `training-bound` (short answers, two epochs a batch: the trainer bounds the step once
   generation has enough devices). Each static split of K inference devices between
   generators and scorers is run (the trainer has a device of its own), then the job
   with `placement.rebalance = true` from a deliberately bad split (one generator, K-1
   scorers); its samples/s over the steps after its last move is compared with the best
   static split's; its decisions (`rebalance/*` fields of metrics.jsonl) are listed.

Every node process gets its own cores: `placement.cpu_threads` = cores // devices (this
process runs one torch thread). Load average is printed with every number and written
to `--out` with the per-run rates.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from bench.output import write_json
from rlhf_async import job
from rlhf_async.config import load_config
from rlhf_async.control.client import call_coordinator, read_coordinator_file
from rlhf_async.control.reshape import ReshapeError, Scale
from rlhf_async.control.scale import request_scale
from rlhf_async.job.local import run_dir_of
from rlhf_async.log import configure_logging
from rlhf_async.metrics import read_metrics
from rlhf_async.runtime import run_loop

# the long-tail bench's tails (bench/longtail.py TAILS): long = 90% 3-6 digits, 10% 7-96
LONG = ["task.min_len=3", "task.short_len=6", "task.max_len=96", "task.long_fraction=0.1",
        "generation.max_new_tokens=100", "model.max_positions=208",
        "train.max_tokens_per_microbatch=2048"]
SHORT = ["task.min_len=3", "task.short_len=4", "task.max_len=8", "task.long_fraction=0.0",
         "generation.max_new_tokens=12", "model.max_positions=32", "train.epochs=2"]
CONFIGS = {"generation-bound": LONG, "training-bound": SHORT}
SEP1 = ["placement.strategy=separation", "algo.max_staleness=1"]
# (layers, hidden, heads, prompts per step, responses per prompt, SFT/RM steps)
SIZES = {"full": (4, 256, 4, 16, 4, 120), "quick": (2, 64, 4, 4, 2, 15)}


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def rate(records: list[dict]) -> float:
    """Samples per second of wall time over `records` (step records)."""
    return sum(r["samples"] for r in records) / max(1e-9, sum(r["time_step"] for r in records))


def base(args: argparse.Namespace, devices: int, name: str) -> list[str]:
    layers, hidden, heads, prompts, group, pre = SIZES["quick" if args.quick else "full"]
    return [f"model.layers={layers}", f"model.hidden={hidden}", f"model.heads={heads}",
            "algo.name=grpo", f"algo.group_size={group}", "train.minibatches=1",
            f"train.prompts_per_step={prompts}", f"sft.steps={pre}",
            f"reward_model.steps={pre}", "reward_model.heldout_pairs=64",
            f"run.eval_prompts={8 if args.quick else 32}", "run.plot=false",
            "run.progress=false", "run.checkpoint_every=0", f"run.output_dir={args.runs}",
            f"run.cache_dir={args.runs}/cache", *SEP1, f"placement.devices={devices}",
            f"placement.cpu_threads={max(1, args.cores // devices)}",
            f"run.name={name}-{time.time_ns()}", *args.overrides]


def split(gens: int, inference: int) -> list[str]:
    """Trainer on device 0, generators on 1..gens, scorers on the rest of 1..inference."""
    g, s = list(range(1, gens + 1)), list(range(gens + 1, inference + 1))
    return [f"placement.generator={g}", f"placement.generators={gens}",
            f"placement.reward={s}", f"placement.reference={s}", f"placement.scorers={len(s)}"]


def steps_of(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return read_metrics(path) if path.exists() else []


def wait_until(run_dir: Path, stop: threading.Event, pred: Any) -> bool:
    while not pred(steps_of(run_dir)):
        if stop.wait(0.1):
            return False
    return True


def stop_job(run_dir: Path) -> None:
    info = read_coordinator_file(run_dir)
    run_loop(call_coordinator(info["control"], "stop", timeout=30, keys=info.get("keys")))


def exactly_once(run_dir: Path, records: list[dict]) -> dict[str, Any]:
    """Whether every step is there once and every prompt of them was trained once."""
    lines = (run_dir / "trained_samples.jsonl").read_text().splitlines()
    counts = Counter(s for line in lines for s in json.loads(line)["sample_ids"])
    rows = sum(r["samples"] for r in records)
    return {"steps_in_order": [r["step"] for r in records] == list(range(len(records))),
            "samples_trained_once": set(counts.values()) <= {1} and len(counts) == rows,
            "restarts": records[-1].get("faults/restarts", 0) if records else 0}


def scale_run(args: argparse.Namespace) -> dict[str, Any]:
    """Section 1: 1 -> 2 -> 1 generators in one generation-bound job."""
    steady = args.steps_per_phase
    cfg = load_config(None, [*base(args, 4, "scale"), *LONG, *split(1, 2),
                             "train.steps=100000"])  # stopped when measured
    run_dir, marks, stop = run_dir_of(cfg), dict[str, Any](), threading.Event()

    def drive() -> None:
        if not wait_until(run_dir, stop, lambda r: len(r) >= args.warmup + steady):
            return
        marks["up_at"] = len(steps_of(run_dir))
        marks["up"] = run_loop(request_scale(run_dir, Scale(generators=2), 300)).counts
        marks["up_done"] = len(steps_of(run_dir))
        if not wait_until(run_dir, stop, lambda r: sum(x.get("util/gen1", 0) > 0 for x in r)
                          >= steady + 1):
            return
        marks["down_at"] = len(steps_of(run_dir))
        marks["down"] = run_loop(request_scale(run_dir, Scale(generators=1), 300)).counts
        marks["down_done"] = len(steps_of(run_dir))
        if wait_until(run_dir, stop, lambda r: len(r) >= marks["down_done"] + steady + 1):
            stop_job(run_dir)

    thread = threading.Thread(target=drive)
    before_load = load()
    thread.start()
    try:
        job.run(cfg)
    finally:
        stop.set()
        thread.join()
    recs = steps_of(run_dir)
    if "down_done" not in marks:
        raise SystemExit(f"bench.elastic: the scale job ended early ({marks}); see {run_dir}")
    first = next(i for i, r in enumerate(recs) if r.get("util/gen1", 0) > 0)
    before = recs[args.warmup:marks["up_at"]]
    two = recs[first + 1:marks["down_at"]]
    after = recs[marks["down_done"] + 1:]
    out = {"samples_per_s_before": rate(before), "samples_per_s_two_generators": rate(two),
           "samples_per_s_after_down": rate(after), "speedup": rate(two) / rate(before),
           "after_down_vs_before": rate(after) / rate(before),
           "steps": {"before": len(before), "two": len(two), "after": len(after)},
           **marks, "gen1_working_from_step": first, **exactly_once(run_dir, recs),
           "loadavg_before": before_load, "loadavg_after": load(), "run_dir": str(run_dir)}
    print(f"scale: samples/s {out['samples_per_s_before']:.1f} with 1 generator, "
          f"{out['samples_per_s_two_generators']:.1f} with 2 ({out['speedup']:.2f}x), "
          f"{out['samples_per_s_after_down']:.1f} after the scale down; every step once: "
          f"{out['steps_in_order']}, every prompt once: {out['samples_trained_once']}, "
          f"restarts {out['restarts']}; load {before_load} -> {out['loadavg_after']}",
          flush=True)
    return out


def static_run(args: argparse.Namespace, config: str, gens: int) -> dict[str, Any]:
    k = args.inference
    cfg = load_config(None, [*base(args, k + 1, f"static{gens}"), *CONFIGS[config],
                             *split(gens, k), f"train.steps={args.warmup + args.static_steps}"])
    before_load = load()
    s = job.run(cfg)
    recs = read_metrics(Path(s["run_dir"]) / "metrics.jsonl")[args.warmup:]
    util = {k2: sum(r.get(k2, 0) for r in recs) / len(recs)
            for k2 in recs[0] if k2.startswith("util/")}
    out = {"generators": gens, "scorers": k - gens, "samples_per_s": rate(recs),
           "utilisation": {k2: round(v, 3) for k2, v in util.items()},
           "loadavg_before": before_load, "loadavg_after": load()}
    print(f"  {config}: static {gens} generator(s) + {k - gens} scorer(s): "
          f"{out['samples_per_s']:.1f} samples/s; load {before_load} -> {out['loadavg_after']}",
          flush=True)
    return out


def rebalanced_run(args: argparse.Namespace, config: str) -> dict[str, Any]:
    k = args.inference
    cfg = load_config(None, [*base(args, k + 1, "rebalance"), *CONFIGS[config],
                             *split(1, k), "placement.rebalance=true",
                             f"placement.rebalance_every={args.rebalance_every}",
                             f"train.steps={args.rebalance_steps}"])
    before_load = load()
    s = job.run(cfg)
    recs = read_metrics(Path(s["run_dir"]) / "metrics.jsonl")
    decisions = [{"step": r["step"], **{k2.removeprefix("rebalance/"): round(v, 4)
                                        for k2, v in r.items() if k2.startswith("rebalance/")}}
                 for r in recs if "rebalance/gain" in r]
    # measured from two steps after the last move's decision (its new node joined by then)
    moves = [d["step"] for d in decisions if d["moved"]]
    start = max(args.warmup, (moves[-1] + 3) if moves else args.warmup)
    tail = recs[start:]
    shape = json.loads((Path(s["run_dir"]) / "config.json").read_text())["placement"]
    out = {"from": {"generators": 1, "scorers": k - 1},
           "to": {"generators": shape["generators"], "scorers": shape["scorers"]},
           "samples_per_s_after_last_move": rate(tail) if tail else 0.0,
           "steps_measured": len(tail), "decisions": decisions,
           **exactly_once(Path(s["run_dir"]), recs), "loadavg_before": before_load,
           "loadavg_after": load(), "run_dir": s["run_dir"]}
    print(f"  {config}: rebalance from 1 generator + {k - 1} scorers -> "
          f"{out['to']['generators']} + {out['to']['scorers']} ({len(moves)} move(s)): "
          f"{out['samples_per_s_after_last_move']:.1f} samples/s over the last {len(tail)} "
          f"steps; load {before_load} -> {out['loadavg_after']}", flush=True)
    return out


def rebalance_section(args: argparse.Namespace, config: str) -> dict[str, Any]:
    statics = [static_run(args, config, g) for g in range(1, args.inference)]
    best = max(statics, key=lambda x: x["samples_per_s"])
    rb = rebalanced_run(args, config)
    ratio = rb["samples_per_s_after_last_move"] / best["samples_per_s"]
    print(f"{config}: rebalanced {rb['samples_per_s_after_last_move']:.1f} vs best static "
          f"({best['generators']} + {best['scorers']}) {best['samples_per_s']:.1f} samples/s: "
          f"{ratio:.2f} of it (within 10%: {ratio >= 0.9}); load {load()}", flush=True)
    return {"static": statics, "best_static": {k: best[k] for k in ("generators", "scorers",
                                                                    "samples_per_s")},
            "rebalanced": rb, "rebalanced_vs_best": ratio, "within_10_percent": ratio >= 0.9}


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.elastic",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="a tiny model, few steps: checks the mechanics, measures nothing")
    ap.add_argument("--out", default="bench/results/elastic.json")
    ap.add_argument("--runs", default="runs/bench-elastic", help="where the jobs run")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                    help="cores shared out to the node processes")
    ap.add_argument("--inference", type=int, default=4,
                    help="devices shared by generators and scorers in the rebalance jobs")
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out of rates")
    ap.add_argument("--steps-per-phase", type=int, default=8,
                    help="steady steps measured before, with two generators, and after")
    ap.add_argument("--static-steps", type=int, default=10, help="measured steps a split")
    ap.add_argument("--rebalance-steps", type=int, default=30)
    ap.add_argument("--rebalance-every", type=int, default=3)
    ap.add_argument("--sections", nargs="*", default=["scale", *CONFIGS],
                    choices=["scale", *CONFIGS])
    ap.add_argument("overrides", nargs="*", help="config overrides for every job")
    args = ap.parse_args(argv)
    if args.quick:
        args.inference, args.steps_per_phase, args.static_steps = 3, 3, 4
        args.rebalance_steps, args.rebalance_every, args.warmup = 12, 2, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(1)
    configure_logging("warning")
    t0, start_load = time.monotonic(), load()
    print(f"bench.elastic on {args.cores} cores; load average at start {start_load}",
          flush=True)
    out: dict[str, Any] = {"args": vars(args), "cores": args.cores,
                           "loadavg_start": start_load}
    if "scale" in args.sections:
        out["scale"] = scale_run(args)
    for config in CONFIGS:
        if config in args.sections:
            out[config] = rebalance_section(args, config)
    out["wall_s"], out["loadavg_end"] = round(time.monotonic() - t0, 1), load()
    write_json(Path(args.out), out, indent=2)
    print(f"done in {out['wall_s']:.0f} s; load average at end {out['loadavg_end']}; "
          f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ReshapeError as e:
        sys.exit(f"bench.elastic: a scale was refused: {e}")
