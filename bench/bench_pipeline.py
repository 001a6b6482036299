"""Flattening, Interleaving and Separation (max_staleness 0, 1, 2) side by side, same model
and batch, with the cost model's predictions beside the measurements.

    python bench/bench_pipeline.py [--steps 12] [--warmup 2] [--calibrate] [key=value ...]

With --calibrate the cost model is first calibrated on this machine from single-process
runs (`rlhf-async plan --calibrate`); the multi-process strategies are then predicted, so
"predicted vs measured" checks the model, and `auto`'s pick is compared with the best
measured variant.

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
import statistics
import sys
import time
from pathlib import Path

from bench.output import write_json
from rlhf_async import job
from rlhf_async.config import load_config
from rlhf_async.log import configure_logging
from rlhf_async.metrics import read_metrics

VARIANTS = {
    "flattening": ["placement.strategy=flattening"],
    "interleaving": ["placement.strategy=interleaving"],
    "separation k=0": ["placement.strategy=separation", "algo.max_staleness=0"],
    "separation k=1": ["placement.strategy=separation", "algo.max_staleness=1"],
    "separation k=2": ["placement.strategy=separation", "algo.max_staleness=2"],
}
# The paper's bottleneck (needs the deepspeed extra; run with --only): every Flattening rank
# holds a ZeRO-3 shard, so each generation forward gathers the actor, against Separation
# whose generator keeps a whole shadow copy (its single trainer uses the same engine).
ZERO3 = ["train.backend=deepspeed", "train.zero_stage=3"]
# "2-rank": the trainer itself as two ZeRO-3 ranks (slots 0-1), the generator and the
# scorer on a third slot (CPU slots are not pinned: all share this machine's cores)
TWO_RANKS = ["placement.devices=3", "placement.actor=[0,1]"]
OPTIONAL = {
    "flattening zero3": [*VARIANTS["flattening"], *ZERO3],
    "separation k=0 zero3": [*VARIANTS["separation k=0"], *ZERO3],
    "separation k=1 zero3": [*VARIANTS["separation k=1"], *ZERO3],
    "separation k=1 zero3 2-rank": [*VARIANTS["separation k=1"], *ZERO3, *TWO_RANKS],
}


def steady(records: list[dict], warmup: int) -> dict:
    rows = records[warmup:]
    if "time_generate" not in rows[0]:  # separation: wall time between trained steps
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


def predicted_step(cfg) -> float:
    from rlhf_async.planning.planner import plan_job
    from rlhf_async.strategies.placement import PlacementError

    try:
        return plan_job(cfg)[1].step_s  # this config's own layout, as it runs
    except PlacementError:
        return float("nan")


def compare_with_model(results: dict, per_round: dict[str, list[dict]], base: list[str]) -> dict:
    """Predicted vs measured step-time ratios against Flattening (measured: the median over
    rounds of the ratio within a round, so slow drifts of background load cancel), and
    whether `auto`'s pick is within 10% of the best measured variant."""
    from rlhf_async.planning.planner import choose

    flat = results.get("flattening")
    if not flat:
        return {}
    steps = {n: [r["wall_s"] / r["steps"] for r in runs] for n, runs in per_round.items()}
    ratio = {n: statistics.median(a / b for a, b in zip(v, steps["flattening"], strict=True))
             for n, v in steps.items()}
    rows = {}
    print(f"\n{'variant':16s} {'measured ms':>11s} {'predicted ms':>12s} {'meas/flat':>9s} "
          f"{'pred/flat':>9s} {'error':>6s}")
    for name, r in results.items():
        p = r["predicted_step_s"] / flat["predicted_step_s"]
        m = ratio[name]
        rows[name] = {"measured_step_s": statistics.median(steps[name]),
                      "predicted_step_s": r["predicted_step_s"], "measured_ratio": m,
                      "predicted_ratio": p, "error": p / m - 1}
        print(f"{name:16s} {statistics.median(steps[name]) * 1e3:11.1f} "
              f"{r['predicted_step_s'] * 1e3:12.1f} {m:9.2f} {p:9.2f} {p / m - 1:+6.0%}")
    out: dict = {"ratios": rows}
    for k in (0, 1, 2):
        cfg = load_config(None, [*base, f"algo.max_staleness={k}", "placement.strategy=auto"])
        picked, reason = choose(cfg)
        name = picked.strategy if picked.strategy != "separation" else f"separation k={k}"
        same_k = [n for n in results if n in VARIANTS
                  and (not n.startswith("separation") or n.endswith(f"={k}"))]
        best = min(same_k, key=lambda n: ratio[n])
        if name in ratio:
            gap = ratio[name] / ratio[best] - 1
            out[f"auto k={k}"] = {"picked": name, "best_measured": best, "gap": gap,
                                  "reason": reason}
            print(f"auto (max_staleness {k}) picks {name}: {gap:+.0%} vs the best measured "
                  f"({best})")
    return out


def run_variant(name: str, extra: list[str], base: list[str], warmup: int) -> dict:
    tag = name.replace(" ", "").replace("=", "")
    cfg = load_config(None, base + extra + [f"run.name={tag}-{time.time_ns()}"])
    summary = job.run(cfg)
    records = read_metrics(Path(summary["run_dir"]) / "metrics.jsonl")
    out = {**steady(records, warmup), "final_hidden_score": summary["final_hidden_score"]}
    print(f"{name:16s} {out['samples_per_s']:8.1f} samples/s", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3,
                    help="variants take turns round by round; medians over rounds")
    ap.add_argument("--out", default="bench/results/pipeline.json")
    ap.add_argument("--only", nargs="*", default=None, choices=[*VARIANTS, *OPTIONAL],
                    help="variant names to run (the zero3 ones only when named here)")
    ap.add_argument("--calibrate", action="store_true",
                    help="calibrate the cost model in every round (single-process runs)")
    ap.add_argument("--calibration", default="bench/results/calibration.json")
    ap.add_argument("overrides", nargs="*", help="config overrides for every variant")
    args = ap.parse_args(argv)
    configure_logging("warning")
    devices = os.cpu_count() or 1
    base = [f"train.steps={args.steps}", "run.progress=false", "run.plot=false",
            f"placement.devices={devices}", "run.output_dir=runs/bench-pipeline",
            "run.eval_prompts=64", *args.overrides]
    variants = {**VARIANTS, **OPTIONAL}
    names = [n for n in variants if (n in VARIANTS and not args.only)
             or n in (args.only or [])]
    per_round: dict[str, list[dict]] = {n: [] for n in names}
    calib_rounds = []
    for r in range(args.rounds):  # taking turns, so background load hits all alike
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
        if args.calibrate:
            from rlhf_async.planning.calibrate import measure_round

            calib_rounds.append(measure_round(load_config(None, base)))
        for name in names if r % 2 == 0 else names[::-1]:  # no variant always runs first
            per_round[name].append(run_variant(name, variants[name], base, args.warmup))
    if args.calibrate:
        from rlhf_async.planning.calibrate import calibrate

        calibrate(load_config(None, base), Path(args.calibration), measured=calib_rounds)
    if Path(args.calibration).exists():
        base.append(f"placement.calibration={json.dumps(args.calibration)}")
    results = {}
    for name, runs in per_round.items():
        ordered = sorted(runs, key=lambda x: x["samples_per_s"])
        cfg = load_config(None, base + variants[name])
        results[name] = {**ordered[len(ordered) // 2], "predicted_step_s": predicted_step(cfg),
                         "rounds_samples_per_s": [x["samples_per_s"] for x in runs]}
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
    model_check = compare_with_model(results, per_round, base)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, {"devices": devices, "steps": args.steps, "warmup": args.warmup,
                     "rounds": args.rounds,
                     "overrides": args.overrides, "results": results,
                     "cost_model": model_check}, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
