"""`rlhf-async plan --calibrate`: measure this machine and write a calibration JSON.

Measures one device's matmul peak per dtype at `placement.cpu_threads` threads (what a
run's `mfu/*` metrics divide by, `placement.peak_flops`), one CPU slot's peak matmul FLOP/s
for the fit (the faster of fp32 and bf16) and copy
bandwidth, gloo collective latency and bandwidth between two processes, then short
Flattening runs of the given config: one process at two batch sizes, to fit per phase
(generate, score, train) a fixed cost per layer pass and an effective fraction of the
measured peak FLOP/s,
    t_phase = layer_passes * call_s + flops / (flops_per_s * eff)
and `placement.devices` processes, to fit the effective cost of one collective inside a
training step. Interleaving and Separation are then *predicted* from these numbers, so the
benchmark's comparison with their measured runs is a real check.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlhf_async.config import JobConfig
from rlhf_async.engines.process_group import exit_rank, free_port, rank_group
from rlhf_async.metrics import read_metrics
from rlhf_async.modeling.flops import measure_peak
from rlhf_async.modeling.precision import DTYPES
from rlhf_async.planning.costmodel import Calibration, ModelShape, Workload, train_collectives
from rlhf_async.planning.machine import CPU_DEVICE, shape_of, workload_of
from rlhf_async.strategies import flattening
from rlhf_async.strategies.registry import plan_placement
from rlhf_async.task import make_task
from rlhf_async.task.artefacts import prepare_artefacts


def _matmul_flops(dtype: torch.dtype = torch.float32) -> float:
    a, b = torch.randn(384, 384, dtype=dtype), torch.randn(384, 384, dtype=dtype)
    a @ b
    t0 = time.perf_counter()
    for _ in range(20):
        a @ b
    return 20 * 2 * 384**3 / (time.perf_counter() - t0)


def peak_flops() -> dict[str, float]:
    """One slot's matmul FLOP/s in fp32 and bf16, and the peak: the faster of the two (bf16
    runs up to 4x faster on CPUs with AVX-512 BF16 and is emulated, slower, without). The
    fit measures each phase's efficiency against the peak, so a config that computes in
    bf16 gets an efficiency at most 1 instead of one clipped against fp32's speed."""
    out = {"fp32": _matmul_flops(torch.float32), "bf16": _matmul_flops(torch.bfloat16)}
    return {**out, "peak": max(out.values())}


def device_peaks(threads: int, seconds: float = 1.0) -> dict[str, float]:
    """One device's matmul peak per dtype at its `threads` torch threads (a CPU slot of
    `placement.cpu_threads`): what the run's `mfu/*` metrics divide by (`device_peak` in
    machine.py reads it back from the calibration JSON)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return {"threads": threads, **{name: measure_peak(DTYPES[name], seconds=seconds)
                                       for name in ("fp32", "bf16")}}
    finally:
        torch.set_num_threads(before)


def _copy_bw() -> float:
    x = torch.empty(16 * 2**20, dtype=torch.uint8)
    y = torch.empty_like(x)
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    return 2 * 10 * x.numel() / (time.perf_counter() - t0)  # read + write


def _collective_worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    with rank_group("gloo", port, rank, 2):
        _measure_collectives(rank, out)
    exit_rank()


def _measure_collectives(rank: int, out: str) -> None:
    small, big = torch.zeros(1), torch.zeros(2**20)  # 4 B, 4 MB
    for t in (small, big):
        dist.all_reduce(t)
    t0 = time.perf_counter()
    for _ in range(100):
        dist.all_reduce(small)
    latency = (time.perf_counter() - t0) / 100
    t0 = time.perf_counter()
    for _ in range(10):
        dist.all_reduce(big)
    per = (time.perf_counter() - t0) / 10
    if rank == 0:  # ring all-reduce moves 2 (n-1)/n of the bytes: one buffer for n = 2
        Path(out).write_text(json.dumps({"latency": latency,
                                         "bw": big.numel() * 4 / max(per - latency, 1e-9)}))


def _collectives() -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as d:
        out = f"{d}/c.json"
        mp.spawn(_collective_worker, args=(free_port(), out), nprocs=2, join=True)
        data = json.loads(Path(out).read_text())
    return data["latency"], data["bw"]


def phase_times(cfg: JobConfig, prompts: int, devices: int, steps: int) -> dict[str, float]:
    """Median seconds per phase of a short Flattening run (first step dropped)."""
    c = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, steps=steps, prompts_per_step=prompts),
        placement=dataclasses.replace(cfg.placement, devices=devices, strategy="flattening"),
        run=dataclasses.replace(cfg.run, progress=False))
    art = prepare_artefacts(c, make_task(c))
    with tempfile.TemporaryDirectory() as d:
        placement = plan_placement(c.placement, c.algo.name)
        result = flattening.run(c, placement, art, Path(d))
        records = read_metrics(result.metrics_path)[1:]
    return {p: statistics.median(r[f"time_{p}"] for r in records)
            for p in ("generate", "score", "train")}


def _counts(shape: ModelShape, w: Workload) -> dict[str, tuple[float, float]]:
    """(layer passes, FLOPs) per phase of one process holding the whole batch."""
    seq, P, L = w.prompt_len + w.gen_len, shape.params, shape.layers
    trained = 2 if w.critic else 1
    updates = w.epochs * w.minibatches
    return {"generate": ((w.gen_len + 1) * L, 2 * P * w.samples * seq),
            "score": (2 * L, 2 * 2 * P * w.samples * seq),
            "train": (trained * (1 + 3 * updates) * L,
                      trained * (2 + 6 * w.epochs) * P * w.samples * seq)}


def measure_round(cfg: JobConfig, steps: int = 4) -> dict[str, dict[str, float]]:
    """One round of the runs `fit` needs: one process at the batch and at a quarter, and
    `placement.devices` processes at the batch (for the cost of a collective in a step)."""
    torch.set_num_threads(1)
    big = cfg.train.prompts_per_step
    return {"single_quarter": phase_times(cfg, max(1, big // 4), 1, steps),
            "single": phase_times(cfg, big, 1, steps),
            "multi": phase_times(cfg, big, max(2, cfg.placement.devices), steps)}


def fit(cfg: JobConfig, m: dict[str, dict[str, float]], flops: float,
        latency: float) -> Calibration:
    """Per phase: fixed cost per layer pass and FLOP/s efficiency from the two single-process
    runs; the effective cost of one collective from the multi-process training phase (it
    includes waiting for the slower rank, which dominates on a busy machine)."""
    shape, work = shape_of(cfg), workload_of(cfg)
    big = cfg.train.prompts_per_step
    G = cfg.algo.group_size
    w_half = dataclasses.replace(work, samples=max(1, big // 4) * G)
    w_big = dataclasses.replace(work, samples=big * G)
    out: dict[str, float] = {}
    for phase, key in (("generate", "gen"), ("score", "score"), ("train", "train")):
        calls, f_half = _counts(shape, w_half)[phase]
        _, f_big = _counts(shape, w_big)[phase]
        dt = max(m["single"][phase] - m["single_quarter"][phase], 1e-9)
        eff = min(1.0, (f_big - f_half) / flops / dt)
        out[f"{key}_eff"] = eff
        out[f"{key}_call_s"] = max(0.0, (m["single"][phase] - f_big / (flops * eff)) / calls)
    n = max(2, cfg.placement.devices)
    counts = _counts(shape, dataclasses.replace(work, samples=big * G // n))
    single = {ph: counts[ph][0] * out[f"{k}_call_s"] + counts[ph][1] / (flops * out[f"{k}_eff"])
              for ph, k in (("generate", "gen"), ("score", "score"), ("train", "train"))}
    # generate and score have no collectives: their slowdown is the machine's contention
    slow = max(0.5, (m["multi"]["generate"] + m["multi"]["score"])
               / (single["generate"] + single["score"]))
    coll = max(latency, (m["multi"]["train"] / slow - single["train"]) / train_collectives(work))
    return Calibration(source=f"measured by `plan --calibrate` ({time.strftime('%Y-%m-%d')})",
                       bw_eff=1.0, link_eff=1.0, collective_s=coll, parallel_slowdown=slow,
                       **out)


def median_round(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {run: {p: statistics.median(r[run][p] for r in rounds) for p in rounds[0][run]}
            for run in rounds[0]}


def calibrate(cfg: JobConfig, out: Path, steps: int = 4, rounds: int = 1,
              measured: list[dict[str, dict[str, float]]] | None = None) -> dict:
    """Measure (or take `measured` rounds), fit, and write the calibration JSON."""
    slot = device_peaks(cfg.placement.cpu_threads)
    torch.set_num_threads(1)
    peaks, bw = peak_flops(), _copy_bw()
    flops = peaks["peak"]
    latency, link = _collectives()
    rounds_m = measured or [measure_round(cfg, steps) for _ in range(rounds)]
    m = median_round(rounds_m)
    cal = fit(cfg, m, flops, latency)
    device = dataclasses.replace(CPU_DEVICE, flops=flops, mem_bw=bw, link_bw=link,
                                 net_bw=link, memory=CPU_DEVICE.memory)
    data = {"calibration": dataclasses.asdict(cal), "device": dataclasses.asdict(device),
            "measured": {"batch_prompts": cfg.train.prompts_per_step, "rounds": rounds_m,
                         "median": m, "matmul_flops": flops,
                         "matmul_flops_fp32": peaks["fp32"], "matmul_flops_bf16": peaks["bf16"],
                         "peak_flops": slot,
                         "copy_bytes_per_s": bw,
                         "gloo_latency_s": latency, "gloo_bytes_per_s": link}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2))
    return data
