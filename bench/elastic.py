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
   `training-bound` (the same with two epochs a batch: the trainer bounds the step once
   generation has two devices). Each static split of K inference devices between
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
from rlhf_async.config import JobConfig, load_config
from rlhf_async.control.client import call_coordinator, read_coordinator_file
from rlhf_async.control.reshape import ReshapeError, Scale
from rlhf_async.control.scale import request_scale
from rlhf_async.job.local import run_dir_of
from rlhf_async.log import configure_logging
from rlhf_async.metrics import read_metrics
from rlhf_async.runtime import run_loop
from rlhf_async.strategies.separation.clients import PipelineError

# the long-tail bench's tails (bench/longtail.py TAILS): long = 90% 3-6 digits, 10% 7-96
LONG = ["task.min_len=3", "task.short_len=6", "task.max_len=96", "task.long_fraction=0.1",
        "generation.max_new_tokens=100", "model.max_positions=208",
        "train.max_tokens_per_microbatch=2048"]
# the same job with two epochs a batch: the trainer's step doubles, so once generation
# has two devices the trainer bounds the step, and with one it still does not
TRAIN = [*LONG, "train.epochs=2"]
CONFIGS = {"generation-bound": LONG, "training-bound": TRAIN}
SEP1 = ["placement.strategy=separation", "algo.max_staleness=1"]
# (layers, hidden, heads, prompts per step, responses per prompt, SFT steps, RM steps):
# the long-tail bench's 2x64 GPT-2; 128 rows a step, so a generator's chunk costs more
# decode work than the trainer's packed step
SIZES = {"full": (2, 64, 4, 32, 4, 150, 200), "quick": (2, 64, 4, 4, 2, 15, 15)}


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def rate(records: list[dict]) -> float:
    """Samples per second of wall time over `records` (step records)."""
    return sum(r["samples"] for r in records) / max(1e-9, sum(r["time_step"] for r in records))


def base(args: argparse.Namespace, devices: int, name: str) -> list[str]:
    layers, hidden, heads, prompts, group, sft, rm = SIZES["quick" if args.quick else "full"]
    return [f"model.layers={layers}", f"model.hidden={hidden}", f"model.heads={heads}",
            "algo.name=grpo", f"algo.group_size={group}", "train.minibatches=1",
            f"train.prompts_per_step={prompts}", f"sft.steps={sft}",
            f"reward_model.steps={rm}", "reward_model.heldout_pairs=64",
            f"run.eval_prompts={8 if args.quick else 32}", "run.plot=false",
            "run.progress=false", "run.checkpoint_every=0", f"run.output_dir={args.runs}",
            f"run.cache_dir={args.runs}/cache", *SEP1, f"placement.devices={devices}",
            f"placement.cpu_threads={max(1, args.cores // devices)}",
            f"run.name={name}-{time.time_ns()}", *args.overrides]


def config(args: argparse.Namespace, devices: int, name: str, *over: str) -> JobConfig:
    """A job of this bench: `base` with `over` (a shape, a split, its steps)."""
    return load_config(None, [*base(args, devices, name), *over])


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
    cfg = config(args, 4, "scale", *LONG, *split(1, 2), "train.steps=100000")  # stopped
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


def static_run(args: argparse.Namespace, name: str, gens: int) -> dict[str, Any]:
    k = args.inference
    cfg = config(args, k + 1, f"static{gens}", *CONFIGS[name], *split(gens, k),
                 f"train.steps={args.warmup + args.static_steps}")
    before_load = load()
    s = job.run(cfg)
    recs = read_metrics(Path(s["run_dir"]) / "metrics.jsonl")[args.warmup:]
    util = {k2: sum(r.get(k2, 0) for r in recs) / len(recs)
            for k2 in recs[0] if k2.startswith("util/")}
    out = {"generators": gens, "scorers": k - gens, "samples_per_s": rate(recs),
           "utilisation": {k2: round(v, 3) for k2, v in util.items()},
           "loadavg_before": before_load, "loadavg_after": load()}
    print(f"  {name}: static {gens} generator(s) + {k - gens} scorer(s): "
          f"{out['samples_per_s']:.1f} samples/s; load {before_load} -> {out['loadavg_after']}",
          flush=True)
    return out


def settled_from(recs: list[dict]) -> int:
    """Where a rebalanced job's current shape starts to be measured: two steps after its
    last change of shape (a node's util/* appears once it works, and is gone once it is
    retired)."""
    shapes = [frozenset(k for k in r if k.startswith("util/")) for r in recs]
    changed = [i for i in range(1, len(recs)) if shapes[i] != shapes[i - 1]]
    return changed[-1] + 2 if changed else 0


def converged(recs: list[dict], measured: int) -> bool:
    """The last decision kept the shape, came after its last change, and `measured` steps
    of that shape are in."""
    start = settled_from(recs)
    last = [r for r in recs if "rebalance/moved" in r][-1:]
    return bool(last) and last[0]["step"] >= start and not last[0]["rebalance/moved"] \
        and len(recs) - start >= measured


def rebalanced_run(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """From the bad split, with placement.rebalance on, until it has converged (stopped
    then) or `--rebalance-steps` steps."""
    k = args.inference
    cfg = config(args, k + 1, "rebalance", *CONFIGS[name], *split(1, k),
                 "placement.rebalance=true", f"placement.rebalance_every={args.rebalance_every}",
                 f"train.steps={args.rebalance_steps}")
    run_dir, stop = run_dir_of(cfg), threading.Event()
    measured = max(args.static_steps, args.rebalance_every + 1)

    def watch() -> None:
        if wait_until(run_dir, stop, lambda r: converged(r, measured)):
            stop_job(run_dir)

    thread = threading.Thread(target=watch)
    before_load = load()
    thread.start()
    try:
        s = job.run(cfg)
    finally:
        stop.set()
        thread.join()
    recs = read_metrics(run_dir / "metrics.jsonl")
    decisions = [{"step": r["step"], **{k2.removeprefix("rebalance/"): round(v, 4)
                                        for k2, v in r.items() if k2.startswith("rebalance/")}}
                 for r in recs if "rebalance/gain" in r]
    moves = [d["step"] for d in decisions if d["moved"]]
    tail = recs[max(args.warmup, settled_from(recs)):]
    shape = json.loads((run_dir / "config.json").read_text())["placement"]
    out = {"from": {"generators": 1, "scorers": k - 1},
           "to": {"generators": shape["generators"], "scorers": shape["scorers"]},
           "samples_per_s_after_last_move": rate(tail) if tail else 0.0,
           "steps_measured": len(tail), "decisions": decisions,
           "converged": converged(recs, measured), "stopped": bool(s.get("stopped")),
           **exactly_once(run_dir, recs), "loadavg_before": before_load,
           "loadavg_after": load(), "run_dir": str(run_dir)}
    print(f"  {name}: rebalance from 1 generator + {k - 1} scorers -> "
          f"{out['to']['generators']} + {out['to']['scorers']} ({len(moves)} move(s)): "
          f"{out['samples_per_s_after_last_move']:.1f} samples/s over the last {len(tail)} "
          f"steps; load {before_load} -> {out['loadavg_after']}", flush=True)
    return out


def rebalance_section(args: argparse.Namespace, name: str) -> dict[str, Any]:
    statics = [static_run(args, name, g) for g in range(1, args.inference)]
    best = max(statics, key=lambda x: x["samples_per_s"])
    rb = rebalanced_run(args, name)
    ratio = rb["samples_per_s_after_last_move"] / best["samples_per_s"]
    bad = statics[0]  # the split the rebalanced job starts from: was it bad?
    print(f"{name}: rebalanced {rb['samples_per_s_after_last_move']:.1f} vs best static "
          f"({best['generators']} + {best['scorers']}) {best['samples_per_s']:.1f} samples/s: "
          f"{ratio:.2f} of it (within 10%: {ratio >= 0.9}); the split it started from ran "
          f"at {bad['samples_per_s'] / best['samples_per_s']:.2f} of the best; load {load()}",
          flush=True)
    return {"static": statics, "best_static": {k: best[k] for k in ("generators", "scorers",
                                                                    "samples_per_s")},
            "bad_split_vs_best": bad["samples_per_s"] / best["samples_per_s"],
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
    ap.add_argument("--rebalance-steps", type=int, default=120,
                    help="most steps of a rebalanced job (stopped once it has converged)")
    ap.add_argument("--rebalance-every", type=int, default=3)
    ap.add_argument("--sections", nargs="*", default=["scale", *CONFIGS],
                    choices=["scale", *CONFIGS])
    ap.add_argument("overrides", nargs="*", help="config overrides for every job")
    args = ap.parse_args(argv)
    if args.quick:
        args.inference, args.steps_per_phase, args.static_steps = 3, 3, 4
        args.rebalance_steps, args.rebalance_every, args.warmup = 80, 2, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    # the SFT/RM stages and the evaluations run in this process, before and after the
    # nodes run: all cores then; one on a shared box (--quick)
    torch.set_num_threads(1 if args.quick else args.cores)
    configure_logging("warning")
    t0, start_load = time.monotonic(), load()
    print(f"bench.elastic on {args.cores} cores; load average at start {start_load}",
          flush=True)
    out: dict[str, Any] = {"args": vars(args), "cores": args.cores,
                           "loadavg_start": start_load}
    sections = {"scale": scale_run, **{c: lambda a, c=c: rebalance_section(a, c)
                                        for c in CONFIGS}}
    for name, section in sections.items():
        if name not in args.sections:
            continue
        try:
            out[name] = section(args)
        except (PipelineError, SystemExit) as e:  # one section's failure, the others run
            print(f"bench.elastic: section {name} failed: {e}", flush=True)
            out[name] = {"error": str(e)}
        # written after every section: a run cut short keeps what it measured
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
