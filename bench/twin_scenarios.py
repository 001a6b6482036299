"""The cluster in a box under change: Separation jobs on simulated GPUs (`placement.device =
sim`, docs/howto/twin.md) scaled, rebalanced and killed while they run, each node process
running its real program.

    python -m bench.twin_scenarios elastic                    # 8 -> 16 -> 8 generators
    python -m bench.twin_scenarios chaos --nodes 64 --kills 20  # SIGKILLs + a SIGSTOP

Every job is `bench.twin.run_job` (its own process and session, memory watched); the
results go to bench/results/twin_*.json beside the steady-state runs of bench/twin.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
from pathlib import Path
from typing import Any

from bench.output import write_json
from bench.twin import _records, fitting_ranks, layout, run_job
from rlhf_async.control.chaos import freeze_nodes, kill_random
from rlhf_async.control.reshape import Scale
from rlhf_async.runtime import run_loop
from rlhf_async.strategies.registry import request_scale

# trainer ranks enough that generation bounds the step (one epoch a batch)
ELASTIC = ["placement.devices=40", f"placement.actor={list(range(16))}",
           f"placement.generator={list(range(16, 24))}", "placement.reward=[24,25]",
           "train.prompts_per_step=512", "train.epochs=1", "sim.lengths=long_tail",
           "algo.max_staleness=1"]


def elastic(out_dir: Path, steps: int, scale: float, min_available_gb: float) -> dict[str, Any]:
    """A generation-bound job (long-tail lengths: the KV cache holds few rows, so a
    generator decodes its chunk in several waves), scaled 8 -> 16 generators after step
    `steps // 3` and back after `2 * steps // 3`; samples/s in each phase (simulated)."""
    run_dir = out_dir / "elastic"
    marks: list[tuple[int, Any]] = []
    ended = threading.Event()

    def scaler() -> None:
        for at, n in ((steps // 3, 16), (2 * steps // 3, 8)):
            while len(_records(run_dir)) < at:
                if ended.wait(0.5):
                    return
            got = run_loop(request_scale(run_dir, Scale(generators=n), timeout=300))
            marks.append((len(_records(run_dir)), got.counts))
    thread = threading.Thread(target=scaler, daemon=True)
    thread.start()
    r = run_job(out_dir, "elastic", [*ELASTIC, f"train.steps={steps}",
                                     f"sim.time_scale={scale}"], min_available_gb, 3600)
    ended.set()
    thread.join()
    recs = _records(run_dir)
    bounds = [m[0] for m in marks] + [len(recs)]
    phases, start = [], 0
    for end in bounds:  # a phase's steps after the scale's own step
        part = [x["samples_per_s"] for x in recs[start + 1: end]] or \
            [x["samples_per_s"] for x in recs[start:end]]
        phases.append(statistics.median(part) if part else None)
        start = end
    return {**r, "scaled_at": marks, "samples_per_s_phases": phases}


def chaos(out_dir: Path, nodes: int, steps: int, kills: int, scale: float,
          min_available_gb: float) -> dict[str, Any]:
    """`kills` SIGKILLs of random ready nodes (every step from step 2: generators,
    scorers, trainer ranks alike) and one generator SIGSTOPped (declared dead, replaced,
    then SIGCONTed), during one job; its exactly-once record."""
    run_dir, ended = out_dir / "chaos", threading.Event()
    killed: list[tuple[str, int]] = []
    frozen: list[dict[str, Any]] = []
    threads = [threading.Thread(target=kill_random, args=(run_dir, kills, 1, ended, killed, 7),
                                daemon=True),
               threading.Thread(target=freeze_nodes, args=(run_dir, ["gen1"], 3, ended, frozen),
                                daemon=True)]
    for t in threads:
        t.start()
    r = run_job(out_dir, "chaos", [*layout(nodes, max(nodes // 8, fitting_ranks("7B"))),
                                   f"train.steps={steps}", f"sim.time_scale={scale}",
                                   "run.checkpoint_every=1", "runtime.restart_limit=30",
                                   "runtime.time_to_dead=10"], min_available_gb, 3600)
    ended.set()
    for t in threads:
        t.join()
    recs = _records(run_dir)
    return {**r, "killed": killed, "frozen": frozen,
            "restarts": recs[-1].get("faults/restarts", 0) if recs else None}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("elastic", "chaos"))
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--time-scale", type=float, default=0.5)
    ap.add_argument("--min-available-gb", type=float, default=6.0)
    ap.add_argument("--dir", default="runs/twin")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    out_dir = Path(a.dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    if a.what == "chaos":
        r = chaos(out_dir, a.nodes, a.steps, a.kills, a.time_scale, a.min_available_gb)
    else:
        r = elastic(out_dir, a.steps, a.time_scale, a.min_available_gb)
    print(json.dumps(r), flush=True)
    write_json(Path(a.out or f"bench/results/twin_{a.what}.json"),
               {"what": a.what, "time_scale": a.time_scale, "results": [r]})


if __name__ == "__main__":
    main()
