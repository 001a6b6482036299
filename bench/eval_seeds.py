"""Does the default recipe learn on every seed? SFT vs final hidden score per algo.name.

    .venv/bin/python bench/eval_seeds.py [--seeds 0 1 ... 7] [--algos ppo grpo dapo ...] [override ...]
    .venv/bin/python bench/eval_seeds.py --algos ppo --variant sync: \
        --variant k1p:placement.strategy=separation,algo.max_staleness=1,algo.proximal=true

`--variant LABEL:KEY=VALUE,...` (repeatable) runs every algorithm once per variant with those
overrides on top; rows are labelled `algo/LABEL` and each variant's mean is compared with the
first variant's (the baseline) seed by seed.

Each seed trains (or reuses from the cache) its own SFT policy and reward model; every run
is the default `rlhf-async run` job with `algo.name` and `run.seed` set, as a user runs it.
Per run: SFT and final hidden score on the held-out prompts, the peak of the training
curve's hidden score (5-step moving average, on the training prompts), the final KL to the
reference, the reward model's accuracy. A run "collapsed" when its final hidden score is
more than 0.10 below its own peak. Prints the table and the load average, writes the rows
to bench/results/eval_seeds.json (`--out`), every run's per-step curves to
runs/eval_seeds_curves.json (`--curves-out`) and a PNG of every seed's hidden-score curve.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, too
from bench.output import traces_path, write_json
from rlhf_async.config import load_config
from rlhf_async.job import run
from rlhf_async.metrics import read_metrics
from rlhf_async.ops.plotting import pyplot

SMOOTH = 5  # steps in the moving average of the training curve
COLLAPSE = 0.10  # final more than this below the run's own peak


def smoothed(values: list[float], k: int = SMOOTH) -> list[float]:
    return [statistics.mean(values[max(0, i - k + 1): i + 1]) for i in range(len(values))]


def parse_variant(text: str) -> tuple[str, list[str]]:
    """`LABEL:KEY=VALUE,KEY=VALUE` -> (LABEL, overrides); `LABEL:` has none."""
    label, sep, rest = text.partition(":")
    if not sep or not label or "/" in label:
        raise argparse.ArgumentTypeError(
            f"--variant {text!r}: expected LABEL:KEY=VALUE,... (LABEL without '/')")
    overrides = [o for o in rest.split(",") if o]
    if bad := [o for o in overrides if "=" not in o]:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: {bad[0]!r} is not KEY=VALUE")
    return label, overrides


def one_run(algo: str, seed: int, stamp: str, overrides: list[str], label: str = "") -> dict:
    name = f"{algo}/{label}" if label else algo
    cfg = load_config(None, [f"algo.name={algo}", f"run.seed={seed}",
                             f"run.name=eval-{stamp}-{name.replace('/', '-')}-s{seed}",
                             "run.progress=false", "run.plot=false", *overrides])
    load = os.getloadavg()[0]
    s = run(cfg)
    records = read_metrics(Path(s["run_dir"]) / "metrics.jsonl")
    curve = smoothed([r["hidden_score"] for r in records])
    kl = [r["kl"] for r in records]
    return {"algo": name, "seed": seed, "sft": s["sft_hidden_score"],
            "final": s["final_hidden_score"], "peak": max(curve),
            "final_kl": statistics.mean(kl[-SMOOTH:]), "rm_accuracy": s["rm_accuracy"],
            "rl_seconds": s["rl_seconds"], "wall_seconds": s["wall_seconds"],
            "load": [load, os.getloadavg()[0]], "curve": curve, "kl_curve": kl}


CURVES = ("curve", "kl_curve")


def write_results(rows: list[dict], out: Path, curves_out: Path, head: dict) -> None:
    """Each run's summary row to `out`; its per-step curves (two floats a step) to
    `curves_out`, beside the runs: they would be most of a committed summary's size."""
    summary = [{k: v for k, v in r.items() if k not in CURVES} for r in rows]
    curves = [{"algo": r["algo"], "seed": r["seed"], **{k: r[k] for k in CURVES}} for r in rows]
    write_json(out, {**head, "rows": summary})
    write_json(curves_out, {**head, "rows": curves})


def table(rows: list[dict]) -> str:
    width = max([5, *(len(r["algo"]) for r in rows)])
    out = [f"{'algo':{width}} {'seed':>4} {'SFT':>6} {'final':>6} {'gain':>7} {'peak':>6} "
           f"{'KL':>6} {'RM acc':>6}  note"]
    for r in rows:
        note = []
        if r["final"] <= r["sft"]:
            note.append("WORSE than SFT")
        if r["peak"] - r["final"] > COLLAPSE:
            note.append(f"collapsed ({r['peak'] - r['final']:.2f} below peak)")
        out.append(f"{r['algo']:{width}} {r['seed']:>4} {r['sft']:>6.3f} {r['final']:>6.3f} "
                   f"{r['final'] - r['sft']:>+7.3f} {r['peak']:>6.3f} {r['final_kl']:>6.2f} "
                   f"{r['rm_accuracy']:>6.3f}  {', '.join(note)}")
    for algo in dict.fromkeys(r["algo"] for r in rows):
        sel = [r for r in rows if r["algo"] == algo]
        gain = [r["final"] - r["sft"] for r in sel]
        sd = statistics.stdev(gain) if len(gain) > 1 else 0.0
        better = sum(g > 0 for g in gain)
        collapsed = sum(r["peak"] - r["final"] > COLLAPSE for r in sel)
        out.append(f"{algo}: SFT {statistics.mean(r['sft'] for r in sel):.3f} -> final "
                   f"{statistics.mean(r['final'] for r in sel):.3f}, gain "
                   f"{statistics.mean(gain):+.3f} +- {sd:.3f}; {better}/{len(sel)} seeds "
                   f"above SFT, {collapsed} collapsed; mean final KL "
                   f"{statistics.mean(r['final_kl'] for r in sel):.2f}")
    out.extend(versus_baseline(rows))
    return "\n".join(out)


def versus_baseline(rows: list[dict]) -> list[str]:
    """Each variant's final score minus the first variant's of the same algorithm on the
    same seeds (only rows labelled `algo/LABEL`)."""
    labelled = [r for r in rows if "/" in r["algo"]]
    out = []
    for algo in dict.fromkeys(r["algo"].split("/")[0] for r in labelled):
        names = list(dict.fromkeys(r["algo"] for r in labelled if r["algo"].startswith(algo + "/")))
        base = {r["seed"]: r["final"] for r in labelled if r["algo"] == names[0]}
        for name in names[1:]:
            diff = [r["final"] - base[r["seed"]] for r in labelled
                    if r["algo"] == name and r["seed"] in base]
            if diff:
                out.append(f"{name} - {names[0]}: mean {statistics.mean(diff):+.3f} over "
                           f"{len(diff)} seeds (min {min(diff):+.3f}, max {max(diff):+.3f})")
    return out


def plot(rows: list[dict], path: Path, title: str) -> None:
    algos = list(dict.fromkeys(r["algo"] for r in rows))
    plt = pyplot()
    fig, axes = plt.subplots(1, len(algos), figsize=(6 * len(algos), 4), squeeze=False)
    for ax, algo in zip(axes[0], algos, strict=True):
        for r in (r for r in rows if r["algo"] == algo):
            line, = ax.plot(r["curve"], label=f"seed {r['seed']}")
            ax.axhline(r["sft"], color=line.get_color(), linestyle=":", linewidth=0.8)
        ax.set_title(f"{algo}: hidden score ({SMOOTH}-step mean; dotted: SFT)")
        ax.set_xlabel("RL step")
        ax.legend(fontsize=7, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(8)))
    ap.add_argument("--algos", nargs="+", default=["ppo", "grpo"])
    ap.add_argument("--out", default="bench/results/eval_seeds.json")
    ap.add_argument("--curves-out", help="default: runs/<--out's name>_curves.json")
    ap.add_argument("--variant", type=parse_variant, action="append", default=[],
                    help="LABEL:KEY=VALUE,... extra overrides; every algorithm runs once per "
                         "variant (the first is the baseline the others are compared with)")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. train.steps=50")
    args = ap.parse_args()
    stamp, load0, t0 = time.strftime("%Y%m%d-%H%M%S"), os.getloadavg(), time.perf_counter()
    variants = args.variant or [("", [])]
    out = Path(args.out)
    curves_out = traces_path(out, args.curves_out, "curves")
    head: dict = {"overrides": args.overrides, "variants": dict(variants)}
    rows = []
    for seed in args.seeds:
        for algo in args.algos:
            for label, extra in variants:
                rows.append(one_run(algo, seed, stamp, [*args.overrides, *extra], label))
                r = rows[-1]
                print(f"{r['algo']} seed {seed}: SFT {r['sft']:.3f} -> final {r['final']:.3f} "
                      f"(peak {r['peak']:.3f}, KL {r['final_kl']:.2f}) in "
                      f"{r['wall_seconds']:.0f}s, load {r['load'][0]:.1f}-{r['load'][1]:.1f}",
                      file=sys.stderr, flush=True)
                # after every run: a long sweep stopped part way keeps what it measured
                write_results(rows, out, curves_out, {**head, "load": [load0[0], None]})
    load1 = os.getloadavg()
    text = table(rows)
    print(text)
    print(f"load average at start {load0[0]:.1f}, at end {load1[0]:.1f}; "
          f"{time.perf_counter() - t0:.0f}s for {len(rows)} runs")
    write_results(rows, out, curves_out, {**head, "load": [load0[0], load1[0]]})
    plot(rows, out.with_suffix(".png"), "default recipe" + (
        f" + {' '.join(args.overrides)}" if args.overrides else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
