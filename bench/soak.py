"""Soak: a pipeline under sustained load; memory and queue depth must stay flat.

    python bench/soak.py --minutes 10                 # demo pipeline over tcp + CURVE
    python bench/soak.py --minutes 2 --transport ipc --floats 65536

Runs the demo pipeline (sources -> transform -> sink, real node processes under a
coordinator) with an endless stream, samples the RSS of every node process and the queue
depth (messages sent by the sources and not yet received by the sink: everything sitting in
the socket queues) every `--sample-s` seconds, and compares the mean of the last minute with
the mean of the first minute after `--warmup-s`. Writes JSON (every sample plus the summary)
and prints a table. Exit code 1 when a node died or anything grew by more than `--max-growth`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nodes.demo_pipeline import address_maker, build_specs
from rlhf_async.coordinator import Coordinator
from rlhf_async.log import configure_logging
from rlhf_async.runtime import run_loop

ENDLESS = 10**15


async def _sample(coord: Coordinator, procs: dict[str, psutil.Process]) -> dict[str, Any]:
    status = {n: await coord.command(n, "status", timeout=30) for n in procs}
    counters = {n: s["counters"] for n, s in status.items()}
    sent = sum(c.get("sent", 0) for n, c in counters.items() if n.startswith("source"))
    received = counters["sink0"].get("received", 0)
    return {"t": time.monotonic(), "rss": {n: p.memory_info().rss for n, p in procs.items()},
            "sent": sent, "received": received, "queue_depth": sent - received,
            "rejected": sum(c.get("rejected", 0) for c in counters.values()),
            "auth_refused": sum(c.get("auth.refused", 0) for c in counters.values())}


async def soak(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    sock_dir = tempfile.mkdtemp(prefix="soak-")
    samples: list[dict[str, Any]] = []
    try:
        async with Coordinator(run_dir, time_to_dead=30.0) as coord:
            coord.install_signal_handlers()
            specs = build_specs(address_maker(args.transport, sock_dir), messages=ENDLESS,
                                floats=args.floats, hwm=args.hwm, sources=args.sources,
                                progress_every=ENDLESS)
            dead: list[str] = []
            coord.on_event(lambda e: dead.append(f"{e.node_id}: {e.payload['reason']}")
                           if e.kind == "node_dead" else None)
            await coord.launch(specs)
            procs = {n: psutil.Process(node.process.pid)
                     for n, node in coord.nodes.items() if node.process.pid}
            t0 = time.monotonic()
            end = t0 + args.minutes * 60
            while time.monotonic() < end and not coord.stop_requested.is_set():
                samples.append(await _sample(coord, procs))
                s = samples[-1]
                print(f"{s['t'] - t0:7.1f}s  received {s['received']:>10,}  queue "
                      f"{s['queue_depth']:>5}  rss MB "
                      + " ".join(f"{n}={v / 2**20:.1f}" for n, v in s["rss"].items()),
                      flush=True)
                if dead:
                    break
                await asyncio.sleep(args.sample_s)
            return {"samples": samples, "t0": t0, "dead": dead,
                    "coordinator_counters": coord.counters}
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


def _window(samples: list[dict[str, Any]], t0: float, lo: float, hi: float) -> list[dict]:
    return [s for s in samples if lo <= s["t"] - t0 < hi]


def _growth(first: float, last: float) -> float:
    return (last - first) / first if first else 0.0


def summarize(run: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    samples, t0 = run["samples"], run["t0"]
    total = samples[-1]["t"] - t0
    first = _window(samples, t0, args.warmup_s, args.warmup_s + 60)
    last = _window(samples, t0, total - 60, total + 1)
    rows = {}
    for node in samples[0]["rss"]:
        a, b = mean(s["rss"][node] for s in first), mean(s["rss"][node] for s in last)
        rows[f"rss {node}"] = {"first_mb": a / 2**20, "last_mb": b / 2**20,
                               "growth": _growth(a, b)}
    a, b = mean(s["queue_depth"] for s in first), mean(s["queue_depth"] for s in last)
    rows["queue depth (msgs)"] = {"first": a, "last": b, "growth": _growth(a, b)}
    span = lambda w: (w[-1]["received"] - w[0]["received"]) / max(w[-1]["t"] - w[0]["t"], 1e-9)
    return {"rows": rows, "seconds": total, "received": samples[-1]["received"],
            "msgs_per_s_first": span(first), "msgs_per_s_last": span(last),
            "rejected": samples[-1]["rejected"], "auth_refused": samples[-1]["auth_refused"],
            "dead": run["dead"],
            "flat": not run["dead"] and all(abs(r["growth"]) < args.max_growth
                                            for r in rows.values())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--warmup-s", type=float, default=60.0)
    p.add_argument("--sample-s", type=float, default=2.0)
    p.add_argument("--transport", choices=("ipc", "tcp"), default="tcp")
    p.add_argument("--floats", type=int, default=4096, help="float32 values per message")
    p.add_argument("--hwm", type=int, default=64)
    p.add_argument("--sources", type=int, default=2)
    p.add_argument("--max-growth", type=float, default=0.05)
    p.add_argument("--out", type=Path, default=Path("bench/results/soak.json"))
    args = p.parse_args()
    if args.minutes * 60 < args.warmup_s + 120:
        p.error(f"--minutes must leave a first and a last minute after --warmup-s "
                f"({args.warmup_s:.0f}s): at least {(args.warmup_s + 120) / 60:.1f}")
    configure_logging("warning")
    run_dir = Path(tempfile.mkdtemp(prefix="soak-run-"))
    try:
        run = run_loop(soak(args, run_dir))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    summary = summarize(run, args)
    print(f"\nsoak: {args.transport}, {args.sources} sources x {args.floats * 4 / 1024:.0f} KB "
          f"messages, HWM {args.hwm}, {summary['seconds'] / 60:.1f} min, "
          f"{summary['received']:,} messages")
    print(f"{'metric':<24} {'first min':>10} {'last min':>10} {'growth':>8}")
    for name, r in summary["rows"].items():
        a, b = (r["first_mb"], r["last_mb"]) if "first_mb" in r else (r["first"], r["last"])
        print(f"{name:<24} {a:>10.1f} {b:>10.1f} {r['growth']:>+8.1%}")
    print(f"msgs/s first min {summary['msgs_per_s_first']:.0f}, last min "
          f"{summary['msgs_per_s_last']:.0f}; dead nodes: {summary['dead'] or 'none'}; "
          f"flat (|growth| < {args.max_growth:.0%}): {summary['flat']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    env = {"python": platform.python_version(), "cpus": os.cpu_count(),
           "load_avg": os.getloadavg()}
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                    "env": env, "summary": summary,
                                    "samples": run["samples"]}, indent=1))
    return 0 if summary["flat"] else 1


if __name__ == "__main__":
    sys.exit(main())
