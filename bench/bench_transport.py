"""Transport throughput: our Channel (encode + send + recv + decode) vs raw pyzmq (copy=False).

Two processes (sender here, receiver spawned), PUSH/PULL, over ipc:// and tcp://, for 1 KB,
1 MB and 64 MB tensor messages. The receiver times `count` messages after `warmup` ones.
Three implementations take turns run by run: raw (blocking pyzmq), raw_async (plain
zmq.asyncio, no protocol) and ours. MB/s columns are the best of `--repeats` runs; `ratio`
is the median over repeats of ours/raw within a round, `best` the ratio of the best runs,
`vs async` the median of ours/raw_async.
Writes JSON (--out) and prints a table.

    .venv/bin/python bench/bench_transport.py [--quick] [--out bench/results/transport.json]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import zmq
import zmq.asyncio

from bench.output import write_json
from rlhf_async.runtime.loop import run_loop
from rlhf_async.wire.local import free_tcp_port
from rlhf_async.wire.protocol import Message
from rlhf_async.wire.transport import Endpoint, Transport

SIZES = {"1KB": 1 << 10, "1MB": 1 << 20, "64MB": 64 << 20}
COUNTS = {"1KB": 20000, "1MB": 2000, "64MB": 24}  # ~20 MB, ~2 GB, ~1.5 GB per run
HWM = 16
IMPLS = ("raw", "raw_async", "ours")  # raw = blocking pyzmq; raw_async = plain zmq.asyncio


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _schedule(quick: bool, repeats: int, sizes: list[str]) -> list[tuple[str, int, int]]:
    """(size label, warmup, count) for every run, in order; both processes follow it."""
    scale = 10 if quick else 1
    return [(label, max(2, COUNTS[label] // (10 * scale)), max(4, COUNTS[label] // scale))
            for label in sizes for _ in range(repeats)]


def _recv_raw(address: str, schedule: list, conn) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.bind(address)
    conn.send("bound")
    for _, warmup, count in schedule:
        for _ in range(warmup):
            sock.recv(copy=False)
        start, faults = time.perf_counter(), _faults()
        for _ in range(count):
            len(sock.recv(copy=False).buffer)
        conn.send((time.perf_counter() - start, (_faults() - faults) / count))
    sock.close(0)
    ctx.term()


async def _recv_ours(address: str, schedule: list, conn) -> None:
    async with Transport() as transport:
        chan = transport.channel(Endpoint("pull", address, bind=True, hwm=HWM))
        conn.send("bound")
        for _, warmup, count in schedule:
            for _ in range(warmup):
                await chan.recv()
            start, faults = time.perf_counter(), _faults()
            for _ in range(count):
                (await chan.recv()).tensors["x"].numel()
            conn.send((time.perf_counter() - start, (_faults() - faults) / count))


async def _recv_raw_async(address: str, schedule: list, conn) -> None:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.bind(address)
    conn.send("bound")
    for _, warmup, count in schedule:
        for _ in range(warmup):
            await sock.recv(copy=False)
        start, faults = time.perf_counter(), _faults()
        for _ in range(count):
            len((await sock.recv(copy=False)).buffer)
        conn.send((time.perf_counter() - start, (_faults() - faults) / count))
    sock.close(0)
    ctx.term()


def _receiver(impl: str, address: str, schedule: list, conn) -> None:
    torch.set_num_threads(1)
    if impl == "raw":
        _recv_raw(address, schedule, conn)
    elif impl == "raw_async":
        run_loop(_recv_raw_async(address, schedule, conn))
    else:
        run_loop(_recv_ours(address, schedule, conn))


class _RawSender:
    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.SNDHWM, HWM)
        self.sock.connect(address)

    async def send(self, x: torch.Tensor, n: int) -> None:
        payload = memoryview(x.numpy())
        for _ in range(n):
            self.sock.send(payload, copy=False)

    async def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


class _RawAsyncSender(_RawSender):
    def __init__(self, address: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.SNDHWM, HWM)
        self.sock.connect(address)

    async def send(self, x: torch.Tensor, n: int) -> None:
        payload = memoryview(x.numpy())
        for _ in range(n):
            await self.sock.send(payload, copy=False)


class _OurSender:
    def __init__(self, address: str) -> None:
        self.transport = Transport()
        self.chan = self.transport.channel(Endpoint("push", address, hwm=HWM))

    async def send(self, x: torch.Tensor, n: int) -> None:
        for i in range(n):
            await self.chan.send(Message("rollout", meta={"i": i}, tensors={"x": x}))

    async def close(self) -> None:
        await self.transport.close()


async def _alternate(addresses: dict[str, str], schedule: list, conns: dict) -> dict:
    """Sender side: for every run, raw then ours, each waiting for its receiver's timing, so
    background load on a shared machine hits both implementations alike."""
    senders = {"raw": _RawSender(addresses["raw"]),
               "raw_async": _RawAsyncSender(addresses["raw_async"]),
               "ours": _OurSender(addresses["ours"])}
    times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    faults: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    try:
        for run, (label, warmup, count) in enumerate(schedule):
            x = torch.ones(SIZES[label], dtype=torch.uint8)  # [N] bytes, reused: zero-copy
            shift = run % len(IMPLS)  # rotate who goes first
            for impl in IMPLS[shift:] + IMPLS[:shift]:
                await senders[impl].send(x, warmup + count)
                seconds, per_msg = await asyncio.to_thread(conns[impl].recv)
                times[impl].append(seconds)
                faults[impl].append(per_msg)
    finally:
        for sender in senders.values():
            await sender.close()
    return times, faults


def run_scheme(scheme: str, schedule: list) -> tuple[dict[str, list[float]], dict]:
    """Per implementation: seconds of every run, and the receiver's page faults/message."""
    tmp = tempfile.mkdtemp(prefix="bt-", dir="/tmp")
    ctx = mp.get_context("spawn")
    addresses, conns, procs = {}, {}, []
    try:
        for impl in IMPLS:
            addresses[impl] = (f"ipc://{tmp}/{impl}" if scheme == "ipc"
                               else f"tcp://127.0.0.1:{free_tcp_port()}")
            conns[impl], child = ctx.Pipe()
            procs.append(ctx.Process(target=_receiver,
                                     args=(impl, addresses[impl], schedule, child)))
            procs[-1].start()
            assert conns[impl].recv() == "bound"
        return run_loop(_alternate(addresses, schedule, conns))
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/transport.json"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="10x fewer messages")
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--schemes", nargs="+", choices=["ipc", "tcp"], default=["ipc", "tcp"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    schedule = _schedule(args.quick, args.repeats, args.sizes)
    rows = []
    for scheme in args.schemes:
        runs, faults = run_scheme(scheme, schedule)
        for label in args.sizes:
            idx = [i for i, s in enumerate(schedule) if s[0] == label]
            count = schedule[idx[0]][2]
            row = {"scheme": scheme, "size": label, "bytes": SIZES[label], "messages": count}
            for impl, times in runs.items():
                best = min(times[i] for i in idx)  # noise on a shared machine only slows down
                median = statistics.median(times[i] for i in idx)
                row[f"{impl}_mb_per_s"] = round(count * SIZES[label] / best / 1e6, 1)
                row[f"{impl}_msgs_per_s"] = round(count / best, 1)
                row[f"{impl}_median_mb_per_s"] = round(count * SIZES[label] / median / 1e6, 1)
                # minor page faults per received message (median over runs): a fresh
                # buffer faulted in per message shows here (see rlhf_async/wire/allocator.py)
                row[f"{impl}_faults_per_msg"] = round(statistics.median(
                    faults[impl][i] for i in idx), 2)
            # Paired: each repeat ran raw and ours back to back, so their ratio cancels most
            # of the background load; the median over repeats is the headline number.
            row["ratio"] = round(statistics.median(
                runs["raw"][i] / runs["ours"][i] for i in idx), 3)
            row["best_ratio"] = round(row["ours_mb_per_s"] / row["raw_mb_per_s"], 3)
            row["ratio_vs_async"] = round(statistics.median(
                runs["raw_async"][i] / runs["ours"][i] for i in idx), 3)
            rows.append(row)
    machine = {
        "cpu": _cpu_model(), "cores": os.cpu_count(),
        "python": platform.python_version(), "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(), "torch": torch.__version__, "platform": platform.platform(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, {"machine": machine, "hwm": HWM, "repeats": args.repeats,
                          "quick": args.quick, "results": rows}, indent=1)
    print(f"{'scheme':<6} {'size':>5} {'raw MB/s':>10} {'async MB/s':>10} {'ours MB/s':>10} "
          f"{'ratio':>6} {'best':>6} {'vs async':>8} {'raw msg/s':>10} {'ours msg/s':>10} "
          f"{'faults raw/ours':>15}")
    for r in rows:
        print(f"{r['scheme']:<6} {r['size']:>5} {r['raw_mb_per_s']:>10.1f} "
              f"{r['raw_async_mb_per_s']:>10.1f} {r['ours_mb_per_s']:>10.1f} "
              f"{r['ratio']:>6.2f} {r['best_ratio']:>6.2f} {r['ratio_vs_async']:>8.2f} "
              f"{r['raw_msgs_per_s']:>10.0f} {r['ours_msgs_per_s']:>10.0f} "
              f"{r['raw_faults_per_msg']:>7.1f}/{r['ours_faults_per_msg']:<7.1f}")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
