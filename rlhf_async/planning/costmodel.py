"""Cost model: predicted per-phase time and per-device memory of a `Placement`.

Each phase's time on a device is a roofline term (FLOPs / effective FLOP/s, or bytes /
effective memory bandwidth for decoding, whichever is larger) plus a fixed cost per layer
pass (kernel launches, Python), plus collectives (bytes / effective link bandwidth plus a
latency each). Models on disjoint devices run concurrently (phase time = the busiest
device); how the phases make one step is the strategy's (`Strategy.pricing`: in turn for
the lock-step strategies, overlapped stages for Separation; strategies/pricing.py).

What makes Flattening slow at scale is modelled explicitly: when the training states do
not fit one device unsharded, the training copies (actor, critic) are ZeRO-3 sharded over
their data-parallel group (the frozen models stay whole, as the runners hold them), and
*every* generation forward pass (prefill and each decoded token) first gathers the actor's
full weights over the interconnect; the memory the resident models leave is what the KV cache
gets, which bounds the rows decoded at once (more sequential passes when it is small).
A training device also holds one micro-batch's activations during the backward pass
(`activation_plan`); they count towards its peak memory, not towards the KV cache's room
(no strategy generates while it holds them).

The efficiencies and fixed costs come from a `Calibration`: measured on this machine by
`rlhf-async plan --calibrate`, or assumed for GPUs (stated in `ASSUMPTIONS`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rlhf_async.modeling.roofline import (
    DEVICES,
    LLAMA,
    Calibration,
    DeviceSpec,
    GiB,
    ModelShape,
    decode_step_s,
    dtype_bytes,
    forward_s,
    kv_bytes_per_token,
    prefill_s,
    train_step_s,
)
from rlhf_async.strategies.placement import TRAIN, ModelPlacement, Placement
from rlhf_async.strategies.pricing import StepCosts
from rlhf_async.strategies.registry import STRATEGIES

# the shared arithmetic's names stay importable from here, where the planner's users look
__all__ = ["ASSUMPTIONS", "DEVICES", "LLAMA", "Calibration", "DeviceSpec", "GiB",
           "ModelShape", "Prediction", "Workload", "activation_bytes", "activation_plan",
           "dtype_bytes", "kv_cache_room", "memory_plan", "predict", "sharded",
           "train_collectives"]

ASSUMPTIONS = [
    ("LLaMA-1 shapes (7B/13B/33B/65B: 32/40/60/80 layers, hidden 4096/5120/6656/8192, "
    "vocab 32000, no GQA); actor, critic, reward and reference all of the actor's size"),
    ("bf16 weights; training states 16 bytes/param (bf16 weights + grads, fp32 Adam m, v, "
    "master); ZeRO-3 (train.backend = deepspeed, train.zero_stage = 3) over the training "
    "copies' data-parallel group when the unsharded states and activations of a device's "
    "models exceed 75% of its memory, else plain data parallelism; frozen models (reward, "
    "reference) always whole, generators whole or tensor-parallel (on an engine that spans "
    "devices), as this build's runners hold them"),
    ("per step: prompt 512 tokens, 480 generated tokens (the paper's setting), 1024 samples, "
    "1 PPO epoch in 4 minibatches, no gradient accumulation; activation checkpointing: "
    "each layer's bf16 input kept, one layer's activations (16 values per token and hidden "
    "unit) at a time, for actor and critic together"),
    ("only layouts this build's runners execute: whole model copies (no tensor "
    "parallelism), one generator or scorer process per GPU, trainer ranks that divide the "
    "batch"),
    ("effective throughput: 40% of peak FLOP/s in training, 50% in prefill/scoring, 70% of "
    "memory bandwidth when decoding, 70% of link bandwidth in collectives, 30 us per "
    "collective, 30 us per layer pass (CUDA-graph-like decoding)"),
    ("ZeRO-3 generation gathers the full actor for every forward pass (prefill and each "
    "token), not overlapped with compute; 10% of device memory reserved"),
    ("8 GPUs per node on NVLink; across nodes one 400 Gb/s (H100/H200) or 200 Gb/s (A100) "
    "NIC per GPU; Separation's trainer broadcasts bf16 actor weights once per step"),
]


@dataclass(frozen=True)
class Workload:
    samples: int  # sequences per step (prompts x group size)
    prompt_len: int
    gen_len: int
    epochs: int = 1
    minibatches: int = 4
    critic: bool = True
    max_staleness: int = 0
    grad_accum: int = 1  # micro-batches per minibatch
    checkpointing: bool = False  # activations recomputed in the backward pass


@dataclass
class Prediction:
    strategy: str
    step_s: float
    phases: dict[str, float]  # generate, score, train, sync (seconds)
    memory: dict[int, float]  # peak bytes per device: resident models + activations
    feasible: bool
    notes: list[str] = field(default_factory=list)
    activations: dict[int, float] = field(default_factory=dict)  # bytes per training device
    # priced with ZeRO-3-sharded training copies: the job must run train.backend =
    # deepspeed, train.zero_stage = 3 (torch holds them whole, which does not fit)
    zero3: bool = False

    @property
    def peak_memory(self) -> float:
        return max(self.memory.values(), default=0.0)

    @property
    def resident(self) -> dict[int, float]:
        """Bytes per device that stay between phases (what the KV cache cannot use)."""
        return {d: b - self.activations.get(d, 0.0) for d, b in self.memory.items()}


# Activations a training forward keeps for its backward, in values of the compute dtype per
# token, per hidden unit, per layer. Korthikanti et al. 2022 ("Reducing Activation
# Recomputation in Large Transformer Models") count 34 bytes in 16-bit: attention 11, MLP
# 19, layer norms 4, with a fused (flash) attention that keeps no sequence x sequence
# matrix; 2 of them are 1-byte dropout masks, which RL training does without
# (train.disable_dropout), leaving 32 bytes = 16 values.
ACTIVATION_VALUES = 16


def activation_bytes(m: ModelPlacement, shape: ModelShape, w: Workload) -> float:
    """Bytes of one training micro-batch's activations on each device of a training copy:
    rows x sequence x hidden x bytes x (16 per layer; with checkpointing 1 per layer, its
    kept input, plus one layer's 16 while that layer is recomputed)."""
    rows = math.ceil(w.samples / max(1, m.replicas))
    micro = math.ceil(math.ceil(rows / max(1, w.minibatches)) / max(1, w.grad_accum))
    values = shape.layers + ACTIVATION_VALUES if w.checkpointing \
        else ACTIVATION_VALUES * shape.layers
    seq = w.prompt_len + w.gen_len
    return micro * seq * shape.hidden * dtype_bytes(m.dtype) * values / m.tensor_parallel


def activation_plan(p: Placement, shape: ModelShape, w: Workload) -> dict[int, float]:
    """Activation bytes per training device: actor and critic together, since the learner
    builds both losses before either backward frees its graph."""
    acts: dict[int, float] = {}
    for m in p.models:
        if m.runtime == TRAIN:
            for d in m.devices:
                acts[d] = acts.get(d, 0.0) + activation_bytes(m, shape, w)
    return acts


def _state_bytes(runtime: str, dtype: str) -> float:
    """Bytes per parameter of a resident model (training: weights, grads, Adam)."""
    return 16.0 if runtime == TRAIN else float(dtype_bytes(dtype))


def _budget(dev: DeviceSpec) -> float:
    return 0.9 * dev.memory


def _bw(devices: tuple[int, ...], dev: DeviceSpec, cal: Calibration) -> float:
    """Collective bandwidth of a device group: NVLink inside a node, the NIC across."""
    nodes = {d // dev.per_node for d in devices}
    return (dev.link_bw if len(nodes) <= 1 else dev.net_bw) * cal.link_eff


def sharded(m: ModelPlacement, zero3: bool) -> bool:
    """ZeRO-3 shards the training copies only: every runner holds its frozen models whole
    (the reference is a copy of the SFT actor taken before the training engine shards it,
    the reward model loads plain, inference engines keep whole copies)."""
    return zero3 and m.replicas > 1 and m.runtime == TRAIN


def memory_plan(p: Placement, shape: ModelShape, dev: DeviceSpec,
                acts: dict[int, float] | None = None) -> tuple[dict[int, float], bool]:
    """Resident bytes per device and whether the training copies are ZeRO-3 sharded (when
    the unsharded states plus the activations `acts` would crowd a device, and ZeRO-3 has
    a model with several replicas to shard: else there is nothing for it to do)."""
    def per_device(zero3: bool) -> dict[int, float]:
        mem = {d: 0.0 for d in range(p.num_devices)}
        for m in p.models:
            shard = m.tensor_parallel * (m.replicas if sharded(m, zero3) else 1)
            for d in m.devices:
                mem[d] = mem.get(d, 0.0) + _state_bytes(m.runtime, m.dtype) * shape.params / shard
        return mem
    plain = per_device(False)
    crowded = max(b + (acts or {}).get(d, 0.0) for d, b in plain.items()) > 0.75 * _budget(dev)
    if not crowded or not any(sharded(m, True) for m in p.models):
        return plain, False
    return per_device(True), True


def _generator(p: Placement) -> ModelPlacement:
    m = p.model("shadow_actor") or p.model("actor")
    assert m is not None  # every placement holds an actor
    return m


def kv_cache_room(p: Placement, shape: ModelShape, w: Workload, dev: DeviceSpec,
                  mem: dict[int, float]) -> tuple[float, float]:
    """(KV-cache bytes of one full sequence, bytes the resident models leave for it on the
    generator's fullest device)."""
    m = _generator(p)
    seq = w.prompt_len + w.gen_len
    kv_row = kv_bytes_per_token(shape, dtype_bytes(m.dtype), m.tensor_parallel) * seq
    return kv_row, min(_budget(dev) - mem.get(d, 0.0) for d in m.devices)


def _gen_time(p: Placement, shape: ModelShape, w: Workload, dev: DeviceSpec, cal: Calibration,
              mem: dict[int, float], zero3: bool, notes: list[str]) -> float | None:
    """Generation time of the slowest replica; None when not even one row's KV cache fits."""
    m = _generator(p)
    tp, reps = m.tensor_parallel, max(1, m.replicas)
    rows = math.ceil(w.samples / reps)
    kv_row, free = kv_cache_room(p, shape, w, dev, mem)
    fit = min(rows, int(free // kv_row)) if free > 0 else 0
    if fit < 1:
        notes.append("no memory left for the KV cache")
        return None
    passes = math.ceil(rows / fit)
    wbytes = dtype_bytes(m.dtype) * shape.params / tp
    gather = wbytes * (reps - 1) / reps / _bw(m.devices, dev, cal) if sharded(m, zero3) \
        else 0.0
    tp_comm = 2 * shape.layers * cal.collective_s if tp > 1 else 0.0
    fixed = shape.layers * cal.gen_call_s + tp_comm + gather
    total = 0.0
    for i in range(passes):
        c = min(fit, rows - i * fit)
        prefill = prefill_s(shape, c, w.prompt_len, tp, wbytes, dev, cal)
        kv_read = c * kv_row * 0.5  # on average half the sequence is cached
        token = decode_step_s(shape, c, kv_read, tp, wbytes, dev, cal)
        total += prefill + fixed + w.gen_len * (token + fixed)
    if gather:
        notes.append(f"ZeRO-3 generation gathers {wbytes * (reps - 1) / reps / GiB:.1f} GiB "
                     f"per forward pass ({gather * 1e3:.1f} ms each)")
    if passes > 1:
        notes.append(f"KV cache fits {fit} of {rows} rows: {passes} generation passes")
    return total


def _score_times(p: Placement, shape: ModelShape, w: Workload, dev: DeviceSpec,
                 cal: Calibration) -> dict[int, float]:
    """Busy seconds per device scoring (whole frozen models: nothing to gather); owners
    of different models work concurrently."""
    busy = {d: 0.0 for d in range(p.num_devices)}
    seq = w.prompt_len + w.gen_len
    for m in p.models:
        if m.model not in ("reward", "reference"):
            continue
        reps = max(1, m.replicas)
        rows = math.ceil(w.samples / reps)
        t = forward_s(2 * shape.params * rows * seq / m.tensor_parallel, shape.layers,
                       cal.score_call_s, cal.score_eff, dev)
        for d in m.devices:
            busy[d] = busy.get(d, 0.0) + t
    return busy


def _train_times(p: Placement, shape: ModelShape, w: Workload, dev: DeviceSpec,
                 cal: Calibration, zero3: bool) -> dict[int, float]:
    busy = {d: 0.0 for d in range(p.num_devices)}
    seq = w.prompt_len + w.gen_len
    for m in p.models:
        if m.runtime != TRAIN:
            continue
        reps = max(1, m.replicas)
        rows = math.ceil(w.samples / reps)
        t = train_step_s(shape, rows, seq, w.epochs, w.minibatches, m.tensor_parallel, reps,
                         sharded(m, zero3), dtype_bytes(m.dtype), _bw(m.devices, dev, cal),
                         dev, cal)
        if reps > 1 and m.model == "actor":  # the critic's gradients travel with the actor's
            t += train_collectives(w) * cal.collective_s
        for d in m.devices:
            busy[d] = busy.get(d, 0.0) + t
    return busy


def train_collectives(w: Workload) -> int:
    """Collectives of one data-parallel training step besides the gradient volume: per
    update the token count and the gradients, per epoch the minibatch split (2), then
    advantage whitening (2) and the metrics (1)."""
    return 2 * w.epochs * w.minibatches + 2 * w.epochs + 3


def _sync_time(p: Placement, shape: ModelShape, dev: DeviceSpec, cal: Calibration) -> float:
    gen, actor = p.model("shadow_actor"), p.model("actor")
    if gen is None or actor is None:
        return 0.0
    group = tuple(sorted(set(actor.devices[:1]) | set(gen.devices)))
    return dtype_bytes(gen.dtype) * shape.params / _bw(group, dev, cal) + cal.collective_s


def _exchange_time(p: Placement, w: Workload, dev: DeviceSpec, cal: Calibration) -> float:
    """An all-gather of a step's rollouts (token ids, masks, log-probs) and an all-reduce
    of their scores over every device."""
    return 2 * cal.collective_s + 16.0 * w.samples * (w.prompt_len + 3 * w.gen_len) / _bw(
        tuple(range(p.num_devices)), dev, cal)


def predict(p: Placement, shape: ModelShape, w: Workload, dev: DeviceSpec,
            cal: Calibration) -> Prediction:
    """Predicted step time (and its phases) and per-device memory of a placement."""
    notes: list[str] = []
    acts = activation_plan(p, shape, w)
    mem, zero3 = memory_plan(p, shape, dev, acts)
    peak = {d: b + acts.get(d, 0.0) for d, b in mem.items()}
    if max(peak.values()) > _budget(dev):
        d = max(peak, key=lambda x: peak[x])
        notes.append(f"resident models need {mem[d] / GiB:.1f} GiB and training activations "
                     f"{acts.get(d, 0.0) / GiB:.1f} GiB on device {d}, budget "
                     f"{_budget(dev) / GiB:.1f} GiB")
    gen = _gen_time(p, shape, w, dev, cal, mem, zero3, notes)
    score = _score_times(p, shape, w, dev, cal)
    train = _train_times(p, shape, w, dev, cal, zero3)
    costs = StepCosts(generate=gen or math.inf, score=max(score.values()),
                      train=max(train.values()), sync=_sync_time(p, shape, dev, cal),
                      exchange=_exchange_time(p, w, dev, cal), slowdown=cal.parallel_slowdown,
                      pipeline_s=cal.pipeline_step_s, max_staleness=w.max_staleness)
    step, phases = STRATEGIES[p.strategy].pricing.step(p, costs)  # in turn, or overlapped
    step += cal.step_s
    if zero3:
        notes.insert(0, "ZeRO-3 sharding of the training copies (actor, critic)")
    feasible = gen is not None and max(peak.values()) <= _budget(dev)
    return Prediction(p.strategy, step, phases, peak, feasible, notes, acts, zero3)
