"""Soak: a pipeline under sustained load; memory and queue depth must stay flat.

    python bench/soak.py --minutes 10                 # demo pipeline over tcp + CURVE
    python bench/soak.py --minutes 2 --transport ipc --floats 65536

    python bench/soak.py --pipeline separation --minutes 10   # the RLHF job itself

Runs the demo pipeline (sources -> transform -> sink, real node processes under a
coordinator) with an endless stream, or (`--pipeline separation`) the RLHF job with
`placement.strategy=separation` and more steps than fit in `--minutes` (stopped with SIGINT
at the end; queue depth is then the driver's chunks in flight, `queue/*` of metrics.jsonl).
It samples the RSS of every node process and the queue
depth (messages sent by the sources and not yet received by the sink: everything sitting in
the socket queues) every `--sample-s` seconds, and compares the mean of the last minute with
the mean of the first minute after `--warmup-s`. Writes the summary to `--out` (under
bench/results/) and every sample to `--samples-out` (under runs/), and prints a table. Exit code 1 when a node died or anything grew by more than `--max-growth`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.output import traces_path, write_json
from rlhf_async.control.coordinator import Coordinator
from rlhf_async.control.demo import address_maker, build_specs
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
                if len(samples) % args.print_every == 1:
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


def _tree_rss(root: psutil.Process) -> dict[str, int]:
    """RSS of every node process under the job process (keyed by its --spec file name)."""
    out = {"job": root.memory_info().rss}
    for child in root.children(recursive=True):
        try:
            cmd = child.cmdline()
            name = Path(cmd[cmd.index("--spec") + 1]).stem if "--spec" in cmd else str(child.pid)
            out[name] = child.memory_info().rss
        except (psutil.Error, IndexError):
            continue  # exited between listing and reading
    return out


def soak_separation(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    cli = "import sys; from rlhf_async.cli import main; sys.exit(main(sys.argv[1:]))"
    cmd = [sys.executable, "-c", cli, "run", "placement.strategy=separation",
           f"placement.devices={args.devices}", f"train.steps={args.steps}",
           f"run.output_dir={run_dir}", "run.name=soak", "run.plot=false",
           "run.progress=false", "run.checkpoint_every=0", *args.overrides]
    err_path = run_dir / "job.err"
    with open(err_path, "wb") as err:  # a pipe nobody reads would stall a chatty job
        job = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    root, metrics = psutil.Process(job.pid), run_dir / "soak" / "metrics.jsonl"
    samples: list[dict[str, Any]] = []
    t0 = None
    try:
        while job.poll() is None:
            time.sleep(max(args.sample_s, 2.0))  # one step takes seconds
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            if not lines:
                continue  # SFT/reward model and node start-up are not the soak
            t0 = t0 or time.monotonic()
            last = json.loads(lines[-1])
            depth = sum(v for k, v in last.items() if k.startswith("queue/"))
            samples.append({"t": time.monotonic(), "rss": _tree_rss(root), "received":
                            len(lines), "sent": len(lines), "queue_depth": depth,
                            "rejected": 0, "auth_refused": 0})
            print(f"{samples[-1]['t'] - t0:7.1f}s  step {last['step']:>6}  queue {depth:>4}  "
                  "rss MB " + " ".join(f"{n}={v / 2**20:.0f}"
                                       for n, v in samples[-1]["rss"].items()), flush=True)
            if time.monotonic() - t0 > args.minutes * 60:
                job.send_signal(signal.SIGINT)  # the coordinator stops its nodes cleanly
                job.wait(120)
    finally:
        if job.poll() is None:
            job.kill()
    dead = [] if t0 and time.monotonic() - t0 > args.minutes * 60 else [
        f"job exited early with {job.returncode}: {err_path.read_text()[-500:]}"]
    # nodes come and go by name only at start and stop: keep those present throughout
    names = set.intersection(*(set(s["rss"]) for s in samples)) if samples else set()
    for s in samples:
        s["rss"] = {n: v for n, v in s["rss"].items() if n in names}
    return {"samples": samples, "t0": t0 or 0.0, "dead": dead}


def _window(samples: list[dict[str, Any]], t0: float, lo: float, hi: float) -> list[dict]:
    return [s for s in samples if lo <= s["t"] - t0 < hi]


def _growth(first: float, last: float) -> float:
    return (last - first) / first if first else 0.0


def summarize(run: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    samples, t0 = run["samples"], run["t0"]
    total = samples[-1]["t"] - t0
    first = _window(samples, t0, args.warmup_s, args.warmup_s + 60)
    last = _window(samples, t0, total - 60, total + 1)
    steady = _window(samples, t0, args.warmup_s, total + 1)
    rows = {}
    for node in samples[0]["rss"]:
        a, b = mean(s["rss"][node] for s in first), mean(s["rss"][node] for s in last)
        rows[f"rss {node}"] = {"first_mb": a / 2**20, "last_mb": b / 2**20,
                               "growth": _growth(a, b),
                               "trend": _trend(steady, lambda s, n=node: s["rss"][n])}
    a, b = mean(s["queue_depth"] for s in first), mean(s["queue_depth"] for s in last)
    rows["queue depth (msgs)"] = {"first": a, "last": b, "growth": _growth(a, b),
                                  "trend": _trend(steady, lambda s: s["queue_depth"])}
    def span(w):
        return (w[-1]["received"] - w[0]["received"]) / max(w[-1]["t"] - w[0]["t"], 1e-9)
    return {"rows": rows, "seconds": total, "received": samples[-1]["received"],
            "msgs_per_s_first": span(first), "msgs_per_s_last": span(last),
            "rejected": samples[-1]["rejected"], "auth_refused": samples[-1]["auth_refused"],
            "dead": run["dead"],
            "flat": not run["dead"] and all(_flat(r, args.max_growth) for r in rows.values())}


def _trend(samples: list[dict], value: Any) -> float:
    """Least-squares growth over the whole steady period, relative to its mean: less
    sensitive than two one-minute windows to a burst of load from other jobs."""
    ts, ys = [s["t"] for s in samples], [float(value(s)) for s in samples]
    tm, ym = mean(ts), mean(ys)
    var = sum((t - tm) ** 2 for t in ts)
    slope = sum((t - tm) * (y - ym) for t, y in zip(ts, ys, strict=True)) / var if var else 0.0
    return slope * (ts[-1] - ts[0]) / ym if ym else 0.0


def _flat(row: dict[str, float], max_growth: float) -> bool:
    # a queue that holds a chunk or two (Separation's staleness gate) moves by whole
    # messages: one more message is not growth
    small = "first" in row and abs(row["last"] - row["first"]) <= 1
    return small or abs(row["growth"]) < max_growth


def write_results(args: argparse.Namespace, summary: dict, samples: list[dict]) -> None:
    """The summary to `args.out`, every sample to `args.samples_out`: the samples run to
    megabytes an hour, so they stay beside the runs, not with the committed summaries."""
    env = {"python": platform.python_version(), "cpus": os.cpu_count(),
           "load_avg": os.getloadavg()}
    head = {"args": {k: str(v) for k, v in vars(args).items()}, "env": env}
    write_json(args.out, {**head, "summary": summary})
    write_json(args.samples_out, {**head, "samples": samples})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--warmup-s", type=float, default=60.0)
    p.add_argument("--sample-s", type=float, default=0.5)
    p.add_argument("--print-every", type=int, default=20, help="print every Nth sample")
    p.add_argument("--transport", choices=("ipc", "tcp"), default="tcp")
    p.add_argument("--floats", type=int, default=4096, help="float32 values per message")
    p.add_argument("--hwm", type=int, default=64)
    p.add_argument("--sources", type=int, default=2)
    p.add_argument("--max-growth", type=float, default=0.05)
    p.add_argument("--pipeline", choices=("demo", "separation"), default="demo")
    p.add_argument("--devices", type=int, default=3, help="separation: CPU slots")
    p.add_argument("--steps", type=int, default=100_000, help="separation: more than fit")
    p.add_argument("--out", type=Path, help="the summary (default bench/results/soak_PIPELINE.json)")
    p.add_argument("--samples-out", type=Path,
                   help="every sample, raw (default runs/soak_PIPELINE_samples.json)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="separation: further config overrides")
    args = p.parse_args()
    args.out = args.out or Path(f"bench/results/soak_{args.pipeline}.json")
    args.samples_out = traces_path(args.out, args.samples_out, "samples")
    if args.minutes * 60 < args.warmup_s + 120:
        p.error(f"--minutes must leave a first and a last minute after --warmup-s "
                f"({args.warmup_s:.0f}s): at least {(args.warmup_s + 120) / 60:.1f}")
    configure_logging("warning")
    run_dir = Path(tempfile.mkdtemp(prefix="soak-run-"))
    try:
        run = (soak_separation(args, run_dir) if args.pipeline == "separation"
               else run_loop(soak(args, run_dir)))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    if len(run["samples"]) < 2:
        print(f"soak: no steady-state samples; {run['dead'] or 'nothing ran'}", file=sys.stderr)
        return 1
    summary = summarize(run, args)
    what = (f"separation on {args.devices} CPU slots, {summary['received']} RL steps"
            if args.pipeline == "separation" else
            f"demo over {args.transport}, {args.sources} sources x "
            f"{args.floats * 4 / 1024:.0f} KB messages, HWM {args.hwm}, "
            f"{summary['received']:,} messages")
    print(f"\nsoak: {what}, {summary['seconds'] / 60:.1f} min")
    print(f"{'metric':<24} {'first min':>10} {'last min':>10} {'growth':>8} {'trend':>8}")
    for name, r in summary["rows"].items():
        a, b = (r["first_mb"], r["last_mb"]) if "first_mb" in r else (r["first"], r["last"])
        print(f"{name:<24} {a:>10.1f} {b:>10.1f} {r['growth']:>+8.1%} {r['trend']:>+8.1%}")
    unit = "steps/s" if args.pipeline == "separation" else "msgs/s"
    print(f"{unit} first min {summary['msgs_per_s_first']:.2f}, last min "
          f"{summary['msgs_per_s_last']:.2f}; dead nodes: {summary['dead'] or 'none'}; "
          f"flat (|growth| < {args.max_growth:.0%}): {summary['flat']}")
    write_results(args, summary, run["samples"])
    print(f"wrote {args.out} (summary) and {args.samples_out} (samples)")
    return 0 if summary["flat"] else 1


if __name__ == "__main__":
    sys.exit(main())
