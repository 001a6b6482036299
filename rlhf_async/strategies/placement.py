"""Placement as plain data: which node process runs which models on which devices.

A strategy's preset (in the strategy's module) is a function from (placement config, the
algorithm's recipe, per-model overrides) to a `Placement`; its runner applies one. Every
preset goes through the same mechanism here: default device groups per model, then the
per-model overrides of the config (devices, replicas, tensor parallelism, dtype), then the
processes that host them. A `Placement`
prints as a table, round-trips through dicts and is validated as a whole (every problem in
one `PlacementError`) before any process starts.

Devices are slot numbers 0..devices-1: GPUs with `device = "cuda"`, CPU cores otherwise
(one node thread per slot; nodes that share a slot take turns).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

from rlhf_async.config import ConfigError, PlacementConfig
from rlhf_async.engines import ENGINES
from rlhf_async.modeling.precision import Precision, dtype_problems

TRAIN, INFER = "train", "infer"
MODELS = ("actor", "critic", "reward", "reference", "shadow_actor")
DTYPES = ("fp32", "bf16", "fp16")
OVERRIDES = ("replicas", "tensor_parallel", "dtype")


class PlacementError(ConfigError):
    """An invalid placement; `problems` lists every conflict with its config key."""


@dataclass(frozen=True)
class ProcessPlacement:
    node_id: str
    role: str  # worker (flattening, interleaving) | trainer | generator | scorer
    models: tuple[str, ...]  # actor, critic, reward, reference, shadow_actor
    devices: tuple[int, ...]
    runtime: str  # train | infer


@dataclass(frozen=True)
class ModelPlacement:
    """One model's device group and how it is run there."""

    model: str
    devices: tuple[int, ...]
    replicas: int  # data-parallel copies (each on len(devices) // replicas devices)
    tensor_parallel: int
    runtime: str  # train | infer
    backend: str  # its engine: train.backend (torch | deepspeed) for training copies,
    # generation.backend (an `engines.ENGINES` name) for the shadow actor, torch for the rest
    dtype: str  # fp32 | bf16 | fp16


@dataclass(frozen=True)
class Placement:
    strategy: str
    device_kind: str
    num_devices: int
    processes: tuple[ProcessPlacement, ...]
    models: tuple[ModelPlacement, ...] = field(default=())
    reason: str = ""  # why `auto` chose this strategy; empty otherwise
    engine_reason: str = ""  # what generation.backend = auto chose and why; empty otherwise

    def by_role(self, role: str) -> list[ProcessPlacement]:
        return [p for p in self.processes if p.role == role]

    def model(self, name: str) -> ModelPlacement | None:
        return next((m for m in self.models if m.model == name), None)

    def precision(self) -> Precision:
        """Each model's dtype, as the runners apply it (modeling/precision.py)."""
        return Precision({m.model: m.dtype for m in self.models})

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        kind = self.device_kind
        head = f"strategy {self.strategy} on {self.num_devices} {kind} device(s)"
        procs = _columns([("node", "role", "runtime", "devices", "models")] + [
            (p.node_id, p.role, p.runtime, f"{kind}:{ranges(p.devices)}",
             ", ".join(p.models)) for p in self.processes])
        models = _columns([("model", "runtime", "devices", "replicas", "tp", "backend",
                            "dtype")] + [
            (m.model, m.runtime, ranges(m.devices), str(m.replicas), str(m.tensor_parallel),
             m.backend, m.dtype) for m in self.models])
        why = f"\nwhy: {self.reason}" if self.reason else ""
        why += f"\n{self.engine_reason}" if self.engine_reason else ""
        return f"{head}{why}\n\nprocesses\n{procs}\n\nmodels\n{models}"


def _columns(rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)


def ranges(devs: tuple[int, ...]) -> str:
    """(0, 1, 2, 5) -> '0-2,5'."""
    runs: list[list[int]] = []
    for d in devs:
        if runs and runs[-1][1] == d - 1:
            runs[-1][1] = d
        else:
            runs.append([d, d])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


# ---- per-model overrides ----------------------------------------------------------------

def parse_overrides(cfg: PlacementConfig) -> tuple[dict[str, dict[str, object]], list[str]]:
    """{model: {key: value}} from the `model=value` lists, and every problem found."""
    out: dict[str, dict[str, object]] = {}
    problems = []
    for key in OVERRIDES:
        for i, item in enumerate(getattr(cfg, key)):
            if key == "dtype" and item.strip() in DTYPES:  # every model's (`default_dtype`)
                continue
            path = f"placement.{key}[{i}]"
            name, _, raw = item.partition("=")
            name, raw = name.strip(), raw.strip()
            if name not in MODELS or not raw:
                also = f", or one of {', '.join(DTYPES)} for every model" if key == "dtype" else ""
                problems.append(f"{path}: {item!r} is not MODEL=VALUE with MODEL one of "
                                f"{', '.join(MODELS)}{also}")
                continue
            value, problem = _override_value(key, raw)
            if problem:
                problems.append(f"{path}: {problem}")
            else:
                out.setdefault(name, {})[key] = value
    return out, problems


def _override_value(key: str, raw: str) -> tuple[object, str]:
    if key in ("replicas", "tensor_parallel"):
        ok = raw.isdigit() and int(raw) >= 1
        return (int(raw), "") if ok else (None, f"{raw!r} is not an integer >= 1")
    return (raw, "") if raw in DTYPES else (None, f"{raw!r} is not one of {', '.join(DTYPES)}")


def override_int(over: dict[str, dict[str, object]], model: str, key: str,
                 default: int) -> int:
    """`model`'s integer override `key` (replicas, tensor_parallel), or `default`."""
    return int(over.get(model, {}).get(key, default))  # type: ignore[call-overload]  # parse_overrides made it an int


def model_placement(cfg: PlacementConfig, name: str, devices: list[int] | tuple[int, ...],
           runtime: str, over: dict[str, dict[str, object]], replicas: int | None = None
           ) -> ModelPlacement:
    o = over.get(name, {})
    tp = override_int(over, name, "tensor_parallel", 1)
    default_reps = replicas if replicas is not None else max(1, len(devices) // tp)
    # the engine is the job's (`with_engines`), not the placement's
    return ModelPlacement(name, tuple(devices), override_int(over, name, "replicas", default_reps),
                          tp, runtime, "torch", str(o.get("dtype", default_dtype(cfg))))


def default_dtype(cfg: PlacementConfig) -> str:
    """The dtype of a model `placement.dtype` does not name: its bare entry (the last one),
    else bf16 on GPUs (cuda, and the simulated ones: their stand-in models too) and fp32 on
    cpu."""
    bare = [d.strip() for d in cfg.dtype if d.strip() in DTYPES]
    return bare[-1] if bare else "bf16" if cfg.device in ("cuda", "sim") else "fp32"


# ---- checks every strategy shares ----------------------------------------------------

def with_reason(p: Placement, reason: str) -> Placement:
    return replace(p, reason=reason)


def config_problems(cfg: PlacementConfig) -> list[str]:
    """Pinned device ids outside 0..devices-1."""
    out = []
    for key in ("actor", "critic", "reward", "reference", "generator", "teacher"):
        bad = [d for d in getattr(cfg, key) if not 0 <= d < cfg.devices]
        if bad:
            out.append(f"placement.{key}: device ids {bad} outside 0..{cfg.devices - 1} "
                       f"(placement.devices = {cfg.devices})")
    return out


def validate(p: Placement, roles: Sequence[str]) -> list[str]:
    """Conflicts of a placement every strategy rejects, all of them: process `roles` or
    models missing, devices out of range, node ids twice, tensor-parallel sizes that do not
    divide (or replicas that over-subscribe) a model's devices."""
    out = []
    have = {q.role for q in p.processes}
    out += [f"placement: no {r} process" for r in sorted(set(roles) - have)]
    hosted = {m for q in p.processes for m in q.models}
    out += [f"placement: no process hosts the {m} model" for m in ("actor", "reward",
                                                                    "reference")
            if m not in hosted]
    ids = Counter(q.node_id for q in p.processes)  # linear: placements can be huge
    out += [f"placement: node id {i!r} used twice" for i in sorted(i for i, n in ids.items()
                                                                    if n > 1)]
    for q in p.processes:
        bad = [d for d in q.devices if not 0 <= d < p.num_devices]
        if bad or not q.devices:
            out.append(f"placement: {q.node_id} on devices {list(q.devices)}, "
                       f"accepted 0..{p.num_devices - 1}")
    return out + _model_problems(p)


def _model_problems(p: Placement) -> list[str]:
    out = []
    for m in p.models:
        key = f"placement.tensor_parallel ({m.model})"
        if len(m.devices) % m.tensor_parallel:
            out.append(f"{key}: {m.tensor_parallel} does not divide the {len(m.devices)} "
                       f"device(s) of {m.model} ({ranges(m.devices)})")
        elif m.tensor_parallel > 1 and m.replicas * m.tensor_parallel > len(m.devices):
            out.append(f"placement.replicas ({m.model}): {m.replicas} replica(s) x tensor "
                       f"parallel {m.tensor_parallel} over-subscribe its {len(m.devices)} "
                       "device(s)")
    return out


def with_engines(p: Placement, train: str, generate: str) -> Placement:
    """The placement with each model's engine, the one the job configures: `train.backend`
    for training copies, `generation.backend` for the shadow actor, torch for the rest."""
    def engine(m: ModelPlacement) -> str:
        return train if m.runtime == TRAIN else generate if m.model == "shadow_actor" else "torch"
    return replace(p, models=tuple(replace(m, backend=engine(m)) for m in p.models))


def engine_problems(p: Placement, one_replica_per_device: bool = True) -> list[str]:
    """What this build's runners cannot execute (the plan itself may be valid): tensor
    parallelism other than generators' on an engine that spans devices (run `with_engines`
    first), a dtype the device
    cannot run (modeling/precision.py), and (when the runner keeps one copy per device)
    replica counts that differ from that."""
    out = []
    spans = [n for n, e in ENGINES.items() if e.tensor_parallel]  # engines over devices
    for m in p.models:
        if m.tensor_parallel > 1 and not (m.model == "shadow_actor" and m.backend in spans):
            engine = ("; tensor-parallel generators need an engine that spans devices "
                      "(generation.backend = "
                      f"{' | '.join(map(repr, spans))})") if m.model == "shadow_actor" else ""
            out.append(f"placement.tensor_parallel: {m.model}={m.tensor_parallel} is not run "
                       f"by this build's runners (they keep whole copies{engine}); use 1")
        out += dtype_problems(p.device_kind, m.model, m.dtype)
        default_reps = len(m.devices) // m.tensor_parallel
        if one_replica_per_device and m.replicas != default_reps:
            out.append(f"placement.replicas: {m.model}={m.replicas}; under {p.strategy} a "
                       f"model has one replica per device of its group ({default_reps})")
    return out
