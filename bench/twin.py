"""The cluster in a box, measured: Separation jobs on simulated GPUs (`placement.device =
sim`, docs/howto/twin.md), each node process running its real program.

    python -m bench.twin acceptance --nodes 128 --steps 50   # one job; RSS/PSS, s/step
    python -m bench.twin overhead --nodes 8 32 64 128        # control plane vs node count
    python -m bench.twin grid --models 7B 13B --gpus 8 16    # twin vs the cost model
    python -m bench.twin report                              # table + plot of all results

Every job is `rlhf-async run` in a process of its own (a session of its own, so it can be
stopped whole), nodes started by the fork server (`runtime.node_start = fork`: children
share the server's pages). While it runs, the total RSS and PSS of the run process and all
its descendants are sampled, and the box's available memory: below `--min-available-gb`
the job is killed (other jobs share this box). A layout of N GPUs is 3/4 generators, 1/8
scorers, 1/8 trainer ranks (128: 96 / 16 / 16), two samples a prompt, four a generator.

From each run's metrics.jsonl: the simulated step time (median over the steps after the
first two), the real seconds per step, the control plane's real CPU seconds per step
(`control/real_s`: the coordinator, driver and transport) and its share of a simulated
step, exactly-once (trainer's log), and the cost model's prediction of the same placement
(`planning.costmodel.predict`). Load average with
every number. Results: bench/results/twin_*.json. Scaling, rebalancing and chaos jobs:
bench/twin_scenarios.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil

from bench.output import write_json
from rlhf_async.config import load_config
from rlhf_async.config.presets import resolve
from rlhf_async.engines.sim import SimSpec
from rlhf_async.metrics import read_metrics
from rlhf_async.modeling.roofline import DEVICES, LLAMA
from rlhf_async.ops.plotting import pyplot
from rlhf_async.planning.costmodel import Workload, predict
from rlhf_async.strategies.registry import plan_placement

GiB = 1024**3
BASE = ["model.hidden=16", "model.layers=1", "model.heads=2", "sft.steps=1",
        "reward_model.steps=1", "reward_model.heldout_pairs=16", "run.eval_prompts=4",
        "run.plot=false", "run.progress=false", "algo.group_size=2", "algo.max_staleness=1",
        "placement.strategy=separation", "placement.device=sim", "train.backend=sim",
        "train.gradient_checkpointing=true", "runtime.node_start=fork", "runtime.time_to_dead=30", "runtime.step_deadline_s=600",
        "weight_sync.timeout_s=120", "run.checkpoint_every=10"]


def fitting_ranks(model: str, gpu: str = "H100") -> int:
    """The fewest trainer ranks (a power of two) whose ZeRO-3 shares of the actor's and
    critic's training states (2 x 16 bytes a parameter) leave room for activations."""
    states, room, ranks = 32 * LLAMA[model].params, 0.65 * DEVICES[gpu].memory, 1
    while states / ranks > room:
        ranks *= 2
    return ranks


def layout(nodes: int, trainers: int = 0) -> list[str]:
    """1/8 trainer ranks (or `trainers`), then 6/7 of the rest generators and the others
    scorers (at least one each), each on GPUs of its own; 128: 96 / 16 / 16."""
    trainers = trainers or max(1, nodes // 8)
    scorers = max(1, (nodes - trainers) // 7)
    gens = nodes - trainers - scorers
    return [f"placement.devices={nodes}", f"placement.actor={list(range(trainers))}",
            f"placement.generator={list(range(trainers, trainers + gens))}",
            f"placement.reward={list(range(trainers + gens, nodes))}",
            f"train.prompts_per_step={_prompts(gens, trainers)}"]


def _prompts(gens: int, trainers: int) -> int:
    """At least two prompts a generator, dividing over the trainer ranks and generators."""
    step = math.lcm(gens, trainers)
    return step * math.ceil(2 * gens / step)


class Watch:
    """Samples the memory of a process tree and of the box on a thread."""

    def __init__(self, proc: subprocess.Popen[bytes], min_available: float) -> None:
        self.proc, self.min_available = proc, min_available
        self.peak_rss = self.peak_pss = 0.0
        self.low_available = float("inf")
        self.procs = 0
        self.aborted = ""
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def _run(self) -> None:
        n = 0
        while not self.stop.wait(2.0):
            avail = psutil.virtual_memory().available
            self.low_available = min(self.low_available, avail)
            if avail < self.min_available:
                self.aborted = f"available memory {avail / GiB:.1f} GiB"
                os.killpg(self.proc.pid, signal.SIGKILL)
                return
            tree, rss, pss = self._tree(), 0.0, 0.0
            full = n % 5 == 0  # PSS reads every page map: every 10 s
            for p in tree:
                try:
                    if full:
                        info = p.memory_full_info()
                        rss, pss = rss + info.rss, pss + info.pss
                    else:
                        rss += p.memory_info().rss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
            self.procs = max(self.procs, len(tree))
            self.peak_rss = max(self.peak_rss, rss)
            if full:
                self.peak_pss = max(self.peak_pss, pss)
            n += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def run_job(out_dir: Path, name: str, overrides: list[str], min_available_gb: float,
            timeout_s: float) -> dict[str, Any]:
    """One twin job; its summary (memory, times, exactly-once, the cost model's step)."""
    args = [*BASE, f"run.output_dir={json.dumps(str(out_dir))}",
            f"run.cache_dir={json.dumps(str(out_dir / 'cache'))}", f"run.name={name}",
            *overrides]
    load0, t0 = os.getloadavg(), time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "rlhf_async", "run", *args],
                            start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=open(out_dir / f"{name}.log", "wb"))  # noqa: SIM115
    watch = Watch(proc, min_available_gb * GiB)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        rc, watch.aborted = proc.wait(), f"past {timeout_s:.0f} s"
    watch.close()
    wall = time.monotonic() - t0
    run_dir = out_dir / name
    records = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() \
        else []
    steady = records[2:] or records
    counts: Counter[int] = Counter()
    if (run_dir / "trained_samples.jsonl").exists():
        for line in (run_dir / "trained_samples.jsonl").read_text().splitlines():
            counts.update(json.loads(line)["sample_ids"])

    def med(key: str) -> float | None:
        vals = [r[key] for r in steady if isinstance(r.get(key), int | float)]
        return statistics.median(vals) if vals else None
    cfg = load_config(None, args)
    return {"name": name, "nodes": cfg.placement.devices, "rc": rc, "aborted": watch.aborted, "wall_s": round(wall, 1),
            "steps": len(records), "processes": watch.procs,
            "exactly_once": bool(counts) and set(counts.values()) == {1}
            and len(counts) == len(records) * cfg.train.prompts_per_step * 2,
            "peak_rss_gb": round(watch.peak_rss / GiB, 2),
            "peak_pss_gb": round(watch.peak_pss / GiB, 2),
            "low_available_gb": round(watch.low_available / GiB, 1),
            "sim_step_s": med("time_step"), "real_step_s": med("real/time_step"),
            "control_real_s": med("control/real_s"), "control_share": med("control/share"),
            "samples_per_s": med("samples_per_s"), "predicted_step_s": predicted(args),
            "time_scale": cfg.sim.time_scale, "args": overrides,
            "load_start": [round(x, 2) for x in load0],
            "load_end": [round(x, 2) for x in os.getloadavg()]}


def predicted(args: list[str]) -> float:
    """The cost model's step time of the same placement and simulated workload (with the
    staleness gate's cycle: `strategies/separation/pricing.gate_cycle`)."""
    cfg = load_config(None, args)
    spec = SimSpec.of(cfg)
    placement = plan_placement(cfg.placement, cfg.algo.name)
    w = Workload(spec.samples, spec.prompt_tokens, spec.response_tokens, spec.epochs,
                 spec.minibatches, resolve(cfg.algo).has_critic, cfg.algo.max_staleness,
                 checkpointing=cfg.train.gradient_checkpointing)
    return predict(placement, spec.shape, w, spec.device, spec.cal).step_s


def _args_of(r: dict[str, Any]) -> list[str]:
    """The overrides a result of `main` ran with (for results written before they were
    kept): its layout by its name."""
    model = r["name"].split("_")[1] if r["name"].startswith("grid_") else "7B"
    n = _nodes(r)
    return [*BASE, *layout(n, max(n // 8, fitting_ranks(model))), f"sim.model={model}"]


def _records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return read_metrics(path) if path.exists() else []


def _nodes(r: dict[str, Any]) -> int:
    """A result's node count (older results: from its name, e.g. acceptance128)."""
    return int(r.get("nodes") or re.sub(r"^\D*", "", r["name"]).split("_")[0])


def _rows(results_dir: Path) -> list[dict[str, Any]]:
    """Every run of bench/results/twin_*.json with a step, its file's time scale and
    heartbeats (results before the heartbeat board: one message per beat, each answered),
    and the cost model's step as it prices now (staleness gate included) where its
    overrides are known."""
    rows = []
    for f in sorted(results_dir.glob("twin_*.json")):
        body = json.loads(f.read_text())
        for r in body["results"]:
            if not r.get("steps"):
                continue
            r = {"time_scale": body.get("time_scale"),
                 "heartbeats": body.get("heartbeats", "messages"), **r}
            known = r.get("args") or (_args_of(r)[len(BASE):] if r["name"].startswith(
                ("acceptance", "overhead", "grid")) else None)
            if known is not None:
                r["predicted_step_s"] = predicted([*BASE, *known])
            rows.append(r)
    return rows


def report(results_dir: Path) -> str:
    """One markdown table of every bench/results/twin_*.json run, and a plot
    (twin_overhead.png: the control plane's CPU against the simulated step by node count,
    one line per time scale and heartbeat kind; the twin's step against the cost
    model's)."""
    rows = _rows(results_dir)
    lines = ["| run | scale | heartbeats | nodes | steps | once | twin step (sim s) | cost model "
             "(s) | twin / model | real s/step | control CPU s/step | control share | peak "
             "PSS GB | load |", "| --- | ---: | --- | ---: | ---: | --- | ---: | ---: | ---: | "
             "---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['time_scale']} | {r['heartbeats']} | {_nodes(r)} | "
            f"{r['steps']} | {r['exactly_once']} | {r['sim_step_s']:.1f} | "
            f"{r['predicted_step_s']:.1f} | {r['sim_step_s'] / r['predicted_step_s']:.2f} | "
            f"{r['real_step_s']:.2f} | {r['control_real_s']:.3f} | "
            f"{100 * r['control_share']:.2f}% | {r['peak_pss_gb']:.1f} | "
            f"{r['load_start'][0]:.1f}-{r['load_end'][0]:.1f} |")
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    curves: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if r["name"].startswith(("acceptance", "overhead", "grid_7B_")):
            label = f"time scale {r['time_scale']}, heartbeats: {r['heartbeats']}"
            curves.setdefault(label, []).append((_nodes(r), 100 * r["control_share"]))
    for label, points in sorted(curves.items()):
        points.sort()
        a.plot([n for n, _ in points], [c for _, c in points], "o-", label=label)
    a.axhline(1.0, color="k", ls="--", lw=0.8)
    a.set(xlabel="nodes (simulated GPUs)", ylabel="control CPU, % of the simulated step",
          title="control-plane cost vs nodes (7B)")
    a.legend(fontsize=7)
    for real, style in ((False, {"c": "0.6", "marker": "x", "label": "dilated or long-tail"}),
                        (True, {"c": "C0", "label": "time scale 1.0, fixed lengths"})):
        some = [r for r in rows if (r["time_scale"] == 1.0 and r["name"] != "elastic") == real]
        b.scatter([r["predicted_step_s"] for r in some], [r["sim_step_s"] for r in some],
                  **style)  # type: ignore[arg-type]
    b.legend(fontsize=7)
    top = max([r["sim_step_s"] for r in rows] + [1.0])
    for f in (1.0, 1.1):
        b.plot([0, top / f], [0, top], "k--" if f == 1.0 else "k:", lw=0.8)
    b.set(xlabel="cost model step (s)", ylabel="twin step (simulated s)",
          title="twin vs analytical (dotted: +10%)")
    fig.tight_layout()
    fig.savefig(results_dir / "twin_overhead.png", dpi=100)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("acceptance", "overhead", "grid", "report"))
    ap.add_argument("--nodes", type=int, nargs="+", default=[32])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--models", nargs="+", default=["7B"])
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--time-scale", type=float, default=0.1)
    ap.add_argument("--gpu", default="H100", choices=sorted(DEVICES),
                    help="grid: the simulated GPU (33B's scorers fit an H200, not an H100)")
    ap.add_argument("--min-available-gb", type=float, default=6.0)
    ap.add_argument("--timeout-s", type=float, default=1800.0)
    ap.add_argument("--dir", default="runs/twin")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    if a.what == "report":
        print(report(Path("bench/results")))
        return
    out_dir = Path(a.dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    scale = f"sim.time_scale={a.time_scale}"
    jobs: list[tuple[str, list[str]]] = []
    if a.what in ("acceptance", "overhead"):
        jobs = [(f"{a.what}{n}", [*layout(n, max(n // 8, fitting_ranks("7B"))),
                                  f"train.steps={a.steps}", scale]) for n in a.nodes]
    else:
        tag = "" if a.gpu == "H100" else f"_{a.gpu}"
        jobs = [(f"grid_{m}_{g}{tag}", [*layout(g, max(g // 8, fitting_ranks(m, a.gpu))),
                                        f"train.steps={a.steps}", f"sim.model={m}", scale,
                                        f"placement.gpu={a.gpu}"])
                for m in a.models for g in a.gpus if fitting_ranks(m, a.gpu) < g]
    results = []
    for name, overrides in jobs:
        r = run_job(out_dir, name, overrides, a.min_available_gb, a.timeout_s)
        results.append(r)
        print(json.dumps(r), flush=True)
        if r["aborted"]:
            break
    write_json(Path(a.out or f"bench/results/twin_{a.what}.json"),
               {"what": a.what, "time_scale": a.time_scale, "heartbeats": "board",
                "results": results})


if __name__ == "__main__":
    main()
