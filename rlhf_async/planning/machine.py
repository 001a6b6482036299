"""What the planner prices a config with: the device and its calibration (`machine`), the
actor's shape (`shape_of`) and one step's work (`workload_of`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import psutil
import torch

from rlhf_async.config import ConfigError, JobConfig
from rlhf_async.config.presets import resolve
from rlhf_async.modeling.flops import GPU_PEAKS, gpu_kind, measure_peak
from rlhf_async.modeling.precision import DTYPES
from rlhf_async.planning.costmodel import (
    DEVICES,
    LLAMA,
    Calibration,
    DeviceSpec,
    GiB,
    ModelShape,
    Workload,
)
from rlhf_async.task import VOCAB_SIZE
from rlhf_async.task.text import longest_prompt

# measured on the 2-core CI box by `rlhf-async plan --calibrate` (bench config); see
# bench/README.md. A calibration JSON named by placement.calibration replaces it.
CPU_CALIBRATION = Calibration(
    source="built-in: measured on the 2-core CI box (bench config, 2026-11-29)",
    gen_call_s=6.4e-4, score_call_s=6.3e-3, train_call_s=1.8e-3, gen_eff=0.23,
    score_eff=0.32, train_eff=0.34, bw_eff=1.0, link_eff=1.0, collective_s=2.8e-4)
CPU_DEVICE = DeviceSpec("cpu-core", 5.0e10, 8 * GiB, 1.3e10, 1.3e9, 1.3e9, 64)


def load_calibration(path: str) -> tuple[Calibration, DeviceSpec | None]:
    """A calibration JSON written by `calibrate`; ConfigError naming what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
        cal = Calibration(**data["calibration"])
        device = DeviceSpec(**data["device"]) if "device" in data else None
    except FileNotFoundError:
        raise ConfigError([f"placement.calibration: {path!r} not found"]) from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError([(f"placement.calibration: {path!r} is not a calibration JSON "
                           f"from `rlhf-async plan --calibrate` ({e})")]) from None
    return cal, device


def machine(cfg: JobConfig) -> tuple[DeviceSpec, Calibration]:
    """Device spec and calibration the planner uses for this config."""
    cal, device = CPU_CALIBRATION, None
    if cfg.placement.calibration:
        cal, device = load_calibration(cfg.placement.calibration)
    if cfg.placement.device in ("cuda", "sim"):  # (sim: the GPUs it simulates)
        dev = DEVICES[cfg.placement.gpu]
        cal = cal if cfg.placement.calibration else Calibration()
    else:
        dev = device or dataclasses.replace(
            CPU_DEVICE, memory=psutil.virtual_memory().total / max(1, cfg.placement.devices))
    if cfg.placement.memory_gb:
        dev = dataclasses.replace(dev, memory=cfg.placement.memory_gb * GiB / 0.9)
    return dev, cal


def shape_of(cfg: JobConfig) -> ModelShape:
    """The actor's shape: the simulated model's (placement.device = sim), the user's HF
    config, else the built-in tiny model's."""
    if cfg.placement.device == "sim":
        return LLAMA[cfg.sim.model]
    if cfg.model.path:
        hf = json.loads((Path(cfg.model.path) / "config.json").read_text())
        h = int(hf.get("hidden_size", hf.get("n_embd", 0)))
        layers = int(hf.get("num_hidden_layers", hf.get("n_layer", 0)))
        vocab = int(hf.get("vocab_size", 0))
        inter = int(hf.get("intermediate_size", 4 * h))
        params = layers * (4 * h * h + 3 * h * inter) + 2 * vocab * h
        return ModelShape(Path(cfg.model.path).name, float(params), layers, h, vocab)
    h, layers, vocab = cfg.model.hidden, cfg.model.layers, VOCAB_SIZE
    params = 12 * layers * h * h + (vocab + cfg.model.max_positions) * h
    return ModelShape("built-in", float(params), layers, h, vocab)


def workload_of(cfg: JobConfig) -> Workload:
    prompt_len = longest_prompt(cfg.model.path, cfg.task) if cfg.task.name == "text" \
        else cfg.task.max_len + 2
    gen_len = cfg.generation.max_new_tokens
    if cfg.placement.device == "sim":  # the simulated lengths, not the stand-in task's
        prompt_len, gen_len = cfg.sim.prompt_tokens, cfg.sim.response_tokens
    return Workload(cfg.train.prompts_per_step * cfg.algo.group_size, prompt_len, gen_len,
                    cfg.train.epochs, cfg.train.minibatches,
                    resolve(cfg.algo).has_critic, cfg.algo.max_staleness, cfg.train.grad_accum,
                    cfg.train.gradient_checkpointing)


def device_peak(cfg: JobConfig, dtype: str) -> tuple[float, str]:
    """One device's peak FLOP/s in `dtype` (the actor's) and where it comes from:
    placement.peak_flops when set; on GPUs the data sheet of the visible device (else
    placement.gpu's); on CPU the peak `plan --calibrate` measured at this thread count,
    else a short measurement now (the best of a few products: a loaded box only slows it)."""
    p = cfg.placement
    if p.peak_flops:
        return p.peak_flops, "placement.peak_flops"
    if p.device == "cuda":
        name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
        kind = gpu_kind(name) or p.gpu
        return GPU_PEAKS[kind][dtype], f"{kind} data sheet, {dtype} dense"
    if p.calibration:
        measured = json.loads(Path(p.calibration).read_text()).get("measured", {})
        peak = measured.get("peak_flops", {})
        if peak.get("threads") == p.cpu_threads and dtype in peak:
            return float(peak[dtype]), f"{p.calibration} ({dtype}, {p.cpu_threads} threads)"
    threads = torch.get_num_threads()
    torch.set_num_threads(p.cpu_threads)
    try:
        flops = measure_peak(DTYPES[dtype], n=512, seconds=0.15)
    finally:
        torch.set_num_threads(threads)
    return flops, f"measured now ({dtype} matmul, {p.cpu_threads} threads)"
