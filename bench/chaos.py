"""Chaos, the long variant: SIGKILL nodes of one Separation run N times (default 20) and
check that it completes with every prompt trained exactly once.

    python bench/chaos.py [--kills 20] [--every 4] [key=value ...]

Counts come from the trainer's own log (RUN_DIR/trained_samples.jsonl); writes
bench/results/chaos.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from bench.output import write_json
from rlhf_async import job
from rlhf_async.config import load_config
from rlhf_async.control.chaos import kill_nodes, random_order
from rlhf_async.log import configure_logging


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--every", type=int, default=4, help="trained steps between kills")
    ap.add_argument("--out", default="bench/results/chaos.json")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    configure_logging("warning")
    steps = 2 + args.every * args.kills + 10  # room for every kill before the run ends
    name = f"chaos-{int(time.time())}"
    cfg = load_config(None, [
        "placement.strategy=separation", "placement.devices=3", "placement.generators=2",
        "placement.scorers=1", "algo.max_staleness=1", "run.checkpoint_every=1", f"train.steps={steps}",
        f"runtime.restart_limit={args.kills}", "runtime.time_to_dead=5",
        "weight_sync.timeout_s=10", "run.output_dir=runs/bench-chaos", f"run.name={name}",
        "run.plot=false", "run.progress=false", *args.overrides])
    run_dir = Path(cfg.run.output_dir) / name
    order = random_order(["trainer", "gen0", "gen1", "scorer0"], args.kills)
    victims: list = []
    stop = threading.Event()
    killer = threading.Thread(target=kill_nodes, args=(run_dir, order, args.every, stop, victims))
    killer.start()
    t0 = time.perf_counter()
    try:
        summary = job.run(cfg)
    finally:
        stop.set()
        killer.join()
    counts = Counter(s for line in (run_dir / "trained_samples.jsonl").read_text().splitlines()
                     for s in json.loads(line)["sample_ids"])
    expected = steps * cfg.train.prompts_per_step * cfg.algo.group_size
    result = {"kills": len(victims), "victims": victims, "steps": steps,
              "samples_expected": expected, "samples_trained": len(counts),
              "trained_twice": sum(1 for c in counts.values() if c > 1),
              "exactly_once": set(counts) == set(range(expected))
              and set(counts.values()) == {1},
              "wall_s": time.perf_counter() - t0,
              "final_hidden_score": summary["final_hidden_score"]}
    print(json.dumps(result, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(Path(args.out), result, indent=1)
    return 0 if result["exactly_once"] and len(victims) == args.kills else 1


if __name__ == "__main__":
    sys.exit(main())
