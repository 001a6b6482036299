"""The cluster in a box under change: Separation jobs on simulated GPUs (`placement.device =
sim`, docs/howto/twin.md) scaled, rebalanced and killed while they run, each node process
running its real program.

    python -m bench.twin_scenarios elastic            # 8 -> 16 -> 8 generators, one run
    python -m bench.twin_scenarios rebalance          # static splits, then rebalancing
    python -m bench.twin_scenarios chaos --nodes 64   # 20 SIGKILLs + a SIGSTOP (~4 GB)

Every job is `bench.twin.run_job` (its own process and session, memory watched); the
results go to bench/results/twin_*.json beside the steady-state runs of bench/twin.py.
"""

from __future__ import annotations

import argparse
import json
import threading
from collections import Counter
from pathlib import Path
from typing import Any

from bench.output import write_json
from bench.twin import BASE, _records, fitting_ranks, layout, run_job
from rlhf_async.config import load_config
from rlhf_async.config.presets import resolve
from rlhf_async.control.chaos import freeze_nodes, kill_random
from rlhf_async.control.reshape import Scale
from rlhf_async.engines.sim import SimSpec
from rlhf_async.planning.costmodel import Workload, predict
from rlhf_async.runtime import run_loop
from rlhf_async.strategies.registry import plan_placement, request_scale

# A generation-bound job: LLaMA-7B, GRPO (no critic), 256-token prompts and 2048-token
# responses of one length (no tail to wait for), k = 3 (the gate's cycle, (generate + score
# + train + sync) / (k + 1), stays below the generators' step). A generator's KV cache holds
# 52 such rows; one chunk a generator, so 832 samples a step are 2 x 52 rows a generator at
# 8 and 52 at 16: both full. Trainer ranks (8, one NVLink node) and scorers (4) keep up with
# 16 generators (cost model: 33 s and 26 s against 41 s generating).
ELASTIC = ["placement.devices=32", f"placement.actor={list(range(8))}",
           f"placement.generator={list(range(8, 16))}", "placement.reward=[16,17,18,19]",
           "algo.name=grpo", "algo.max_staleness=3", "train.prompts_per_step=416",
           "train.epochs=1", "sim.lengths=fixed", "sim.prompt_tokens=256",
           "sim.response_tokens=2048"]


def elastic(out_dir: Path, steps: int, scale: float, min_available_gb: float,
            name: str = "elastic") -> dict[str, Any]:
    """`ELASTIC`, scaled 8 -> 16 generators through `rlhf-async scale`'s request after a
    third of the steps and back to 8 after two thirds; samples/s of each phase (simulated,
    the median of its steps once the chunks dispatched before the scale are through)."""
    run_dir = out_dir / name
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
    args = [*ELASTIC, f"train.steps={steps}", f"sim.time_scale={scale}"]
    r = run_job(out_dir, name, args, min_available_gb, 3600)
    ended.set()
    thread.join()
    recs = _records(run_dir)
    phases = phase_rates(recs, [m[0] for m in marks], settle=4)
    up = phases[1] / phases[0] if len(phases) > 1 and phases[0] and phases[1] else None
    return {**r, "scaled_at": marks, "samples_per_s_phases": phases,
            "speedup": None if up is None else round(up, 3),
            "model_samples_per_s": {n: model_rate([*BASE, *args], n) for n in (8, 16)}}


def phase_rates(records: list[dict[str, Any]], marks: list[int],
                settle: int) -> list[float | None]:
    """Samples/s of each phase between `marks` (steps trained when a scale returned): its
    samples over its simulated seconds, leaving out its first `settle` steps (chunks
    dispatched before the scale, k + 1 steps of them, still run on the old shape). Not a
    median of steps: a trainer that catches up on queued chunks trains a few steps fast,
    which says nothing of the rate the shape sustains."""
    out: list[float | None] = []
    for start, end in zip([0, *marks], [*marks, len(records)], strict=True):
        part = records[start + settle:end]
        secs = sum(r["time_step"] for r in part)
        out.append(round(sum(r["samples_per_s"] * r["time_step"] for r in part) / secs, 3)
                   if part and secs > 0 else None)
    return out


def model_rate(args: list[str], generators: int) -> float:
    """The cost model's samples/s of `args` with `generators` generators (its own, then
    free devices, as a scale takes them), critic or none as the algorithm trains."""
    pc = load_config(None, args).placement
    used = {*pc.actor, *pc.reward, *pc.reference}
    free = [d for d in range(pc.devices) if d not in used]
    cfg = load_config(None, [*args, f"placement.generator={free[:generators]}"])
    spec = SimSpec.of(cfg)
    w = Workload(spec.samples, spec.prompt_tokens, spec.response_tokens, spec.epochs,
                 spec.minibatches, resolve(cfg.algo).has_critic, cfg.algo.max_staleness,
                 checkpointing=cfg.train.gradient_checkpointing)
    pred = predict(plan_placement(cfg.placement, cfg.algo.name), spec.shape, w, spec.device,
                   spec.cal)
    return round(spec.samples / pred.step_s, 3)


# Two job shapes for rebalancing, each on trainer ranks of its own and `devices` more that
# generators and scorers split: (overrides, trainer ranks, devices, the bad split to start
# from as (generators, scorers), the static splits to measure).
SHAPES: dict[str, tuple[list[str], int, int, tuple[int, int], list[tuple[int, int]]]] = {
    # generation bound at its best split: ELASTIC's job (GRPO, 2048-token responses, k = 3)
    # on 4 trainer ranks, 416 samples a step (a generator's chunk 52-83 rows, its KV cache
    # holds 52): best 8 + 2 (generators 9.4 samples/s, scorers 16, trainer 12.8 by the cost
    # model); from 5 + 5 three moves
    "generation": (["algo.name=grpo", "algo.max_staleness=3", "train.prompts_per_step=208",
                    "train.epochs=1", "sim.lengths=fixed", "sim.prompt_tokens=256",
                    "sim.response_tokens=2048"], 4, 10, (5, 5),
                   [(5, 5), (6, 4), (7, 3), (8, 2), (9, 1)]),
    # training bound at its best: PPO (actor and critic), 512 + 480 tokens, k = 2, 8 trainer
    # ranks (29 samples/s), 480 samples a step: one scorer (18.6/s) binds, two do not, and
    # three generators (24.8/s) bind again; from 5 + 1 one move
    "training": (["algo.max_staleness=2", "train.prompts_per_step=240", "train.epochs=1",
                  "sim.lengths=fixed"], 8, 6, (5, 1), [(5, 1), (4, 2), (3, 3)]),
}


def split_args(trainers: int, gens: int, scorers: int) -> list[str]:
    """Trainer ranks first, then the generators, then the scorers, a device each."""
    n = trainers + gens + scorers
    return [f"placement.devices={n}", f"placement.actor={list(range(trainers))}",
            f"placement.generator={list(range(trainers, trainers + gens))}",
            f"placement.reward={list(range(trainers + gens, n))}"]


def rebalance(out_dir: Path, shape: str, steps: int, scale: float, every: int,
              min_available_gb: float, static_steps: int,
              static: dict[str, Any] | None = None) -> dict[str, Any]:
    """Each static split of `shape` for `static_steps` (or `static`, the results of an
    earlier run), then `placement.rebalance = true` from the bad split for `steps`:
    samples/s of each static split (once its first k + 1 steps are through) and of the
    rebalancing run after its last move, against the best."""
    over, trainers, _, bad, splits = SHAPES[shape]
    settle = load_config(None, [*BASE, *over]).algo.max_staleness + 1
    static = dict(static or {})
    for g, sc in splits if not static else []:
        name = f"rebalance_{shape}_{g}g{sc}s"
        r = run_job(out_dir, name, [*over, *split_args(trainers, g, sc),
                                    f"train.steps={static_steps}", f"sim.time_scale={scale}"],
                    min_available_gb, 3600)
        r["samples_per_s_steady"] = phase_rates(_records(out_dir / name), [], settle)[0]
        static[f"{g}+{sc}"] = r
        print(json.dumps(r), flush=True)
    name = f"rebalance_{shape}_online"
    r = run_job(out_dir, name, [*over, *split_args(trainers, *bad), "placement.rebalance=true",
                                f"placement.rebalance_every={every}", f"train.steps={steps}",
                                f"sim.time_scale={scale}"], min_available_gb, 3600)
    recs = _records(out_dir / name)
    moved = last_shape_change(recs)
    rate = phase_rates(recs[moved:], [], settle)[0]
    best = max((v["samples_per_s_steady"] or 0.0, k) for k, v in static.items())
    return {"shape": shape, "static": static, "online": r,
            "decisions": [{k.removeprefix("rebalance/"): v for k, v in x.items()
                           if k.startswith("rebalance/")} | {"step": x["step"]}
                          for x in recs if "rebalance/gain" in x],
            "final_shape": shape_of(recs[-1]) if recs else None, "final_from_step": moved,
            "online_samples_per_s": rate, "best_static": best[1],
            "best_static_samples_per_s": best[0],
            "online_vs_best": round(rate / best[0], 3) if rate and best[0] else None}


def shape_of(record: dict[str, Any]) -> tuple[int, int]:
    """(generators, scorers) that worked in a step, from its `util/<node>` fields."""
    nodes = [k.removeprefix("util/") for k in record if k.startswith("util/")]
    return (sum(n.startswith("gen") for n in nodes), sum(n.startswith("scorer") for n in nodes))


def last_shape_change(records: list[dict[str, Any]]) -> int:
    """The index of the first record in the final shape's run of records."""
    i = len(records)
    while i > 1 and shape_of(records[i - 2]) == shape_of(records[-1]):
        i -= 1
    return max(0, i - 1)


def chaos(out_dir: Path, nodes: int, steps: int, kills: int, scale: float,
          min_available_gb: float, seed: int = 7) -> dict[str, Any]:
    """`kills` SIGKILLs of random ready nodes (every step from step 2: generators,
    scorers, trainer ranks alike) and one generator SIGSTOPped (declared dead, replaced,
    then SIGCONTed), during one job; its exactly-once record."""
    run_dir, ended = out_dir / "chaos", threading.Event()
    killed: list[tuple[str, int]] = []
    frozen: list[dict[str, Any]] = []
    threads = [threading.Thread(target=kill_random, args=(run_dir, kills, 1, ended, killed, seed),
                                daemon=True),
               threading.Thread(target=freeze_nodes, args=(run_dir, ["gen1"], 3, ended, frozen),
                                daemon=True)]
    for t in threads:
        t.start()
    # a generator killed while a weight-sync group forms leaves the others waiting out
    # weight_sync.timeout_s (a rendezvous is not cut short): 30 s, where 49 ranks form in ~1 s
    r = run_job(out_dir, "chaos", [*layout(nodes, max(nodes // 8, fitting_ranks("7B"))),
                                   f"train.steps={steps}", f"sim.time_scale={scale}",
                                   "run.checkpoint_every=1", "runtime.restart_limit=30",
                                   "runtime.time_to_dead=10", "weight_sync.timeout_s=30"],
                min_available_gb, 3600)
    ended.set()
    for t in threads:
        t.join()
    recs = _records(run_dir)
    roles = Counter("trainer" if n.startswith("trainer") else n.rstrip("0123456789")
                    for n, _ in killed)
    return {**r, "seed": seed, "killed": killed, "killed_roles": dict(roles), "frozen": frozen,
            "faults": {k.removeprefix("faults/"): v for k, v in (recs[-1] if recs else {})
                       .items() if k.startswith("faults/")}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("elastic", "rebalance", "chaos"))
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--every", type=int, default=3, help="placement.rebalance_every")
    ap.add_argument("--static-steps", type=int, default=10)
    ap.add_argument("--reuse", default="", help="rebalance: the static splits of this "
                    "earlier result file (its shapes'), not run again")
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--seed", type=int, default=7, help="chaos: of the victims' draw (7 drew "
                    "no trainer rank at 64 nodes; 23 draws some)")
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--steps", type=int, default=0,
                    help="0: elastic 24, rebalance 30 (the rebalancing run), chaos 40")
    ap.add_argument("--time-scale", type=float, default=0.0, help="0: chaos 0.1, else 0.2")
    ap.add_argument("--min-available-gb", type=float, default=6.0)
    ap.add_argument("--dir", default="runs/twin")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    a.steps = a.steps or {"elastic": 24, "rebalance": 30, "chaos": 40}[a.what]
    a.time_scale = a.time_scale or (0.1 if a.what == "chaos" else 0.2)
    out_dir = Path(a.dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    if a.what == "rebalance":
        earlier = {r["shape"]: r["static"] for r in json.loads(Path(a.reuse).read_text())
                   ["results"]} if a.reuse else {}
        rs = [rebalance(out_dir, shape, a.steps, a.time_scale, a.every, a.min_available_gb,
                        a.static_steps, earlier.get(shape)) for shape in a.shapes]
        write_json(Path(a.out or "bench/results/twin_rebalance.json"),
                   {"what": a.what, "time_scale": a.time_scale, "results": rs})
        return
    if a.what == "chaos":
        r = chaos(out_dir, a.nodes, a.steps, a.kills, a.time_scale, a.min_available_gb, a.seed)
    else:
        r = elastic(out_dir, a.steps, a.time_scale, a.min_available_gb)
    print(json.dumps(r), flush=True)
    write_json(Path(a.out or f"bench/results/twin_{a.what}.json"),
               {"what": a.what, "time_scale": a.time_scale, "results": [r]})


if __name__ == "__main__":
    main()
