"""The per-phase arithmetic of a model on a device, for any placement: what a device can do
(`DeviceSpec`, `DEVICES`), a model's shape (`ModelShape`, `LLAMA`), the efficiencies and
fixed costs a machine achieves (`Calibration`), and the time of one forward, decode step,
prefill or training update from FLOPs and bytes (roofline: FLOPs / effective FLOP/s or
bytes / effective bandwidth, whichever is larger, plus a fixed cost per layer pass).

It lives below both of its users: the planner's cost model (`planning/costmodel.py`), which
composes these terms over a whole `Placement`, and the simulated devices
(`engines/sim/`), which sleep them one scheduling boundary at a time. Neither may see the
other, so the numbers they share are here, once.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1024**3


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    flops: float  # peak dense FLOP/s in the compute dtype
    memory: float  # bytes
    mem_bw: float  # bytes/s
    link_bw: float  # bytes/s per device inside a node (NVLink; loopback for CPU slots)
    net_bw: float  # bytes/s per device across nodes
    per_node: int  # devices per node
    fp32_flops: float = 0.0  # peak dense fp32 FLOP/s (the data sheet's, without tensor cores)


# the data sheets': one table for the cost model, the simulated devices and MFU's peaks
DEVICES = {
    "A100": DeviceSpec("A100-SXM4-80GB", 312e12, 80 * GiB, 2.04e12, 300e9, 25e9, 8, 19.5e12),
    "H100": DeviceSpec("H100-SXM5-80GB", 989e12, 80 * GiB, 3.35e12, 450e9, 50e9, 8, 67e12),
    "H200": DeviceSpec("H200-SXM-141GB", 989e12, 141 * GiB, 4.8e12, 450e9, 50e9, 8, 67e12),
}


@dataclass(frozen=True)
class ModelShape:
    name: str
    params: float
    layers: int
    hidden: int
    vocab: int


LLAMA = {
    "7B": ModelShape("LLaMA-7B", 6.7e9, 32, 4096, 32000),
    "13B": ModelShape("LLaMA-13B", 13.0e9, 40, 5120, 32000),
    "33B": ModelShape("LLaMA-33B", 32.5e9, 60, 6656, 32000),
    "65B": ModelShape("LLaMA-65B", 65.2e9, 80, 8192, 32000),
}


@dataclass(frozen=True)
class Calibration:
    """Effective fractions of the device's peaks and fixed costs (planning/costmodel.py's
    module docstring)."""

    source: str = "assumed (GPU defaults)"
    gen_call_s: float = 3e-5  # per layer per forward pass
    score_call_s: float = 3e-5
    train_call_s: float = 3e-5  # per layer per (forward or backward) pass
    gen_eff: float = 0.5
    score_eff: float = 0.5
    train_eff: float = 0.4
    bw_eff: float = 0.7
    link_eff: float = 0.7
    collective_s: float = 3e-5
    step_s: float = 0.0  # fixed per-step cost of the job loop
    pipeline_step_s: float = 0.0  # extra per step for Separation's queues and control plane
    # how much slower each device works while several are busy at once (1.0 on dedicated
    # GPUs; above 1 on a CPU box shared with other jobs, where busy slots compete)
    parallel_slowdown: float = 1.0


def dtype_bytes(dtype: str) -> int:
    return 4 if dtype == "fp32" else 2


def kv_bytes_per_token(shape: ModelShape, dbytes: int, tp: int = 1) -> float:
    """KV-cache bytes one token of context holds on each of `tp` devices (keys and values
    of every layer)."""
    return 2 * shape.layers * shape.hidden * dbytes / tp


def forward_s(flops: float, layers: int, call_s: float, eff: float, dev: DeviceSpec) -> float:
    """A compute-bound pass: FLOPs at the effective rate plus a fixed cost per layer."""
    return flops / (dev.flops * eff) + layers * call_s


def prefill_s(shape: ModelShape, rows: int, prompt_len: float, tp: int, wbytes: float,
              dev: DeviceSpec, cal: Calibration) -> float:
    """Prefilling `rows` prompts of `prompt_len` tokens (without the fixed per-layer cost,
    which the caller adds with the pass's other fixed costs): compute, or the weights'
    read when that is slower."""
    return max(2 * shape.params * rows * prompt_len / tp / (dev.flops * cal.gen_eff),
               wbytes / (dev.mem_bw * cal.bw_eff))


def decode_step_s(shape: ModelShape, rows: int, kv_bytes: float, tp: int, wbytes: float,
                  dev: DeviceSpec, cal: Calibration) -> float:
    """One decode step of `rows` rows reading `kv_bytes` of KV cache (without the fixed
    per-layer cost): a token's compute per row, or the weights' and the cache's read."""
    return max(2 * shape.params * rows / tp / (dev.flops * cal.gen_eff),
               (wbytes + kv_bytes) / (dev.mem_bw * cal.bw_eff))


def train_compute_s(shape: ModelShape, rows: int, seq: int, epochs: int, minibatches: int,
                    tp: int, dev: DeviceSpec, cal: Calibration) -> float:
    """One model's RL step on one data-parallel rank without communication or the
    optimizer: a forward for the old log-probs/values, then per epoch forward + backward
    over `rows` sequences of `seq` tokens (6 FLOPs per parameter and token)."""
    updates = epochs * minibatches
    flops = (2 + 6 * epochs) * shape.params * rows * seq / tp
    passes = 1 + 3 * updates  # old log-probs/values, then forward + backward
    return forward_s(flops, passes * shape.layers, cal.train_call_s, cal.train_eff, dev)


def optimizer_s(shape: ModelShape, tp: int, shards: int, dev: DeviceSpec,
                cal: Calibration) -> float:
    """One optimizer update: it streams the training states (16 bytes a parameter) of this
    device's share (`shards`: the ZeRO-3 group it is sharded over, else 1)."""
    return 16 * shape.params / (tp * shards) / (dev.mem_bw * cal.bw_eff)


def train_step_s(shape: ModelShape, rows: int, seq: int, epochs: int, minibatches: int,
                 tp: int, reps: int, zero3: bool, dbytes: int, bw: float, dev: DeviceSpec,
                 cal: Calibration) -> float:
    """One trained model's RL step on each of its `reps` data-parallel ranks (`rows`
    sequences each): compute, the gradients' all-reduce over the group's bandwidth `bw`
    (2.5x the volume when ZeRO-3 also gathers the weights), and the optimizer updates.
    Latency-bound collectives besides the volume are the caller's."""
    updates = epochs * minibatches
    t = train_compute_s(shape, rows, seq, epochs, minibatches, tp, dev, cal)
    if reps > 1:
        grads = dbytes * shape.params / tp
        t += updates * 2 * grads * (reps - 1) / reps * (2.5 if zero3 else 1.0) / bw
    return t + updates * optimizer_s(shape, tp, reps if zero3 else 1, dev, cal)
