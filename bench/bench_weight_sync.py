"""Weight-sync micro-benchmark: bucketed broadcast vs one raw broadcast of the same bytes.

Why: bucketing buys bounded sender memory, mixed dtypes and a plan the receivers can check;
it must not cost much wire time. Here one sender and R receiver processes (gloo, CPU) move
a ~50M-parameter float32 model both ways in the same run. Each trial is fenced by barriers
on a separate raw gloo group, so the time is end to end (every receiver has every byte).
The raw baseline is a single `ProcessGroupGloo.broadcast` of one pre-flattened tensor:
no packing, no plan. The receivers' `load_into` (copy into the model) is timed apart.

    .venv/bin/python bench/bench_weight_sync.py --receivers 1 2 --repeats 5
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed import BroadcastOptions, PrefixStore, ProcessGroupGloo, TCPStore

from bench.output import write_json
from rlhf_async.log import configure_logging
from rlhf_async.weight_sync import GroupSpec, TorchBroadcastReceiver, TorchBroadcastSender

HIDDEN, VOCAB, LAYERS = 1024, 32000, 8  # 32.8M embedding + 8 x 2.1M = ~49.6M parameters


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, HIDDEN)
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Linear(HIDDEN, HIDDEN))
            for _ in range(LAYERS)
        )


def _raw_group(spec: GroupSpec, rank: int) -> ProcessGroupGloo:
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    store = TCPStore(spec.master_addr, spec.master_port, None, False, timeout)
    return ProcessGroupGloo(PrefixStore("bench-raw/", store), rank, spec.world_size, timeout)


def _bcast(pg: ProcessGroupGloo, t: torch.Tensor) -> None:
    opts = BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    pg.broadcast([t], opts).wait()


def _receiver(spec_d: dict[str, Any], rank: int, plans: Any, trials: int, out: Any) -> None:
    torch.set_num_threads(1)
    configure_logging("warning")
    spec = GroupSpec.from_dict(spec_d)
    rx = TorchBroadcastReceiver("gloo")
    rx.connect(spec, rank)
    plan = plans.get(timeout=600)
    raw = _raw_group(spec, rank)
    model = Model()
    flat = torch.empty(plan["total_bytes"], dtype=torch.uint8)  # [bytes]
    applies = []
    for _ in range(trials):
        raw.barrier().wait()
        received = rx.receive(plan)
        raw.barrier().wait()
        t0 = time.perf_counter()
        received.load_into(model)
        applies.append(time.perf_counter() - t0)
        raw.barrier().wait()
        _bcast(raw, flat)
        raw.barrier().wait()
    rx.close()
    out.put(applies)


def _run(receivers: int, bucket_mb: float, repeats: int) -> dict[str, Any]:
    model = Model()
    weights = dict(model.state_dict())
    sender = TorchBroadcastSender("gloo", bucket_mb=bucket_mb)
    spec = sender.prepare(GroupSpec("gloo", "127.0.0.1", 0, receivers + 1, timeout_s=300))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    trials = repeats + 1  # the first is a warm-up (connections, page faults)
    plans = ctx.Queue()  # stands in for ZeroMQ
    procs = [
        ctx.Process(target=_receiver, args=(spec.to_dict(), r, plans, trials, out))
        for r in range(1, receivers + 1)
    ]
    for p in procs:
        p.start()
    sender.connect(spec)
    # The layout is fixed, so one plan serves every trial.
    plan = sender.plan(weights, 0)
    for _ in procs:
        plans.put(plan)
    raw = _raw_group(spec, 0)
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in weights.values()])
    flat = torch.nn.functional.pad(flat, (0, plan["total_bytes"] - flat.numel()))  # [bytes]
    bucketed, baseline = [], []
    for _ in range(trials):
        raw.barrier().wait()
        t0 = time.perf_counter()
        sender.send(weights, plan)
        raw.barrier().wait()
        bucketed.append(time.perf_counter() - t0)
        raw.barrier().wait()  # receivers apply their copy before this barrier
        t0 = time.perf_counter()
        _bcast(raw, flat)
        raw.barrier().wait()
        baseline.append(time.perf_counter() - t0)
    applies = [a for _ in procs for a in out.get(timeout=600)[1:]]
    for p in procs:
        p.join(60)
    sender.close()
    b, r = statistics.median(bucketed[1:]), statistics.median(baseline[1:])
    return {
        "receivers": receivers,
        "bucket_mb": bucket_mb,
        "buckets": len(plan["buckets"]),
        "params": sum(t.numel() for t in weights.values()),
        "bytes": plan["total_bytes"],
        "bucketed_s": bucketed[1:],
        "raw_s": baseline[1:],
        "bucketed_median_s": b,
        "raw_median_s": r,
        "ratio": b / r,
        "bucketed_gb_s": plan["total_bytes"] / b / 1e9,
        "apply_median_s": statistics.median(applies),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--receivers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--bucket-mb", type=float, nargs="+", default=[100.0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "weight_sync.json"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    configure_logging("warning")
    rows = [_run(r, mb, args.repeats) for mb in args.bucket_mb for r in args.receivers]
    print(
        f"{'recv':>4} {'bucket MB':>9} {'buckets':>7} {'MB':>6} {'bucketed s':>10} "
        f"{'raw s':>7} {'ratio':>6} {'GB/s':>6} {'apply s':>8}"
    )
    for row in rows:
        print(
            f"{row['receivers']:>4} {row['bucket_mb']:>9g} {row['buckets']:>7} "
            f"{row['bytes'] / 2**20:>6.0f} {row['bucketed_median_s']:>10.3f} "
            f"{row['raw_median_s']:>7.3f} {row['ratio']:>6.2f} {row['bucketed_gb_s']:>6.2f} "
            f"{row['apply_median_s']:>8.3f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    env = {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "backend": "gloo",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "repeats": args.repeats,
        "statistic": "median (first trial is a discarded warm-up)",
    }
    write_json(args.out, {"env": env, "rows": rows}, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
