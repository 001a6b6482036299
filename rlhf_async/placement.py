"""Placement as plain data: which node process runs which models on which devices.

A strategy is a function from (placement config, algorithm) to a `Placement`; the job runner
applies a `Placement`. A `Placement` prints as a table, round-trips through dicts and is
validated as a whole (every problem in one `PlacementError`) before any process starts.

Devices are slot numbers 0..devices-1: GPUs with `device = "cuda"`, CPU cores otherwise
(one node thread per slot; nodes that share a slot take turns).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rlhf_async.config import ConfigError, PlacementConfig

TRAIN, INFER = "train", "infer"


class PlacementError(ConfigError):
    """An invalid placement; `problems` lists every conflict with its config key."""


@dataclass(frozen=True)
class ProcessPlacement:
    node_id: str
    role: str  # worker (flattening) | trainer | generator | scorer
    models: tuple[str, ...]  # actor, critic, reward, reference, shadow_actor
    devices: tuple[int, ...]
    runtime: str  # train | infer


@dataclass(frozen=True)
class Placement:
    strategy: str
    device_kind: str
    num_devices: int
    processes: tuple[ProcessPlacement, ...]

    def by_role(self, role: str) -> list[ProcessPlacement]:
        return [p for p in self.processes if p.role == role]

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        rows = [("node", "role", "runtime", "devices", "models")]
        rows += [(p.node_id, p.role, p.runtime,
                  ",".join(f"{self.device_kind}:{d}" for d in p.devices), ", ".join(p.models))
                 for p in self.processes]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        return f"strategy {self.strategy} on {self.num_devices} {self.device_kind} device(s)\n" + \
            "\n".join(lines)


def _flattening(cfg: PlacementConfig, algo: str) -> Placement:
    models = ("actor", "critic", "reward", "reference") if algo == "ppo" else \
        ("actor", "reward", "reference")
    procs = tuple(ProcessPlacement(f"worker{d}", "worker", models, (d,), TRAIN)
                  for d in range(cfg.devices))
    return Placement("flattening", cfg.device, cfg.devices, procs)


def _spread(devices: list[int], replicas: int) -> list[tuple[int, ...]]:
    """Replica i gets every replicas-th device starting at i (or shares one when fewer)."""
    if len(devices) >= replicas:
        return [tuple(devices[i::replicas]) for i in range(replicas)]
    return [(devices[i % len(devices)],) for i in range(replicas)]


def _separation(cfg: PlacementConfig, algo: str) -> Placement:
    """Trainer (actor + critic) apart from the inference side: shadow actors and scorers.

    Defaults: the trainer on device 0, generators on the other devices, scorers sharing the
    generators' devices (scoring is one forward pass, generation many).
    """
    n = cfg.devices
    rest = list(range(1, n)) or [0]
    trainer = cfg.actor or [0]
    generator = cfg.generator or rest
    scorer = cfg.reward or cfg.reference or generator
    train_models = ("actor", "critic") if algo == "ppo" else ("actor",)
    procs = [ProcessPlacement("trainer", "trainer", train_models, tuple(trainer), TRAIN)]
    procs += [ProcessPlacement(f"gen{i}", "generator", ("shadow_actor",), d, INFER)
              for i, d in enumerate(_spread(generator, cfg.generators))]
    procs += [ProcessPlacement(f"scorer{i}", "scorer", ("reward", "reference"), d, INFER)
              for i, d in enumerate(_spread(scorer, cfg.scorers))]
    return Placement("separation", cfg.device, n, tuple(procs))


STRATEGIES = {"flattening": _flattening, "separation": _separation}


def plan_placement(cfg: PlacementConfig, algo: str) -> Placement:
    """The validated placement for a config; PlacementError lists every problem."""
    problems = _config_problems(cfg)
    if cfg.strategy not in STRATEGIES:
        problems.append(f"placement.strategy: {cfg.strategy!r} cannot be placed yet; "
                        f"available: {', '.join(STRATEGIES)}")
    if problems:
        raise PlacementError(problems)
    placement = STRATEGIES[cfg.strategy](cfg, algo)
    problems = validate(placement)
    if problems:
        raise PlacementError(problems)
    return placement


def _config_problems(cfg: PlacementConfig) -> list[str]:
    out = []
    for key in ("actor", "critic", "reward", "reference", "generator"):
        bad = [d for d in getattr(cfg, key) if not 0 <= d < cfg.devices]
        if bad:
            out.append(f"placement.{key}: device ids {bad} outside 0..{cfg.devices - 1} "
                       f"(placement.devices = {cfg.devices})")
    if cfg.strategy == "separation":
        if cfg.critic and cfg.actor and sorted(cfg.critic) != sorted(cfg.actor):
            out.append("placement.critic: separation trains actor and critic in one trainer "
                       "process; give them the same devices or leave critic empty")
        if cfg.reward and cfg.reference and sorted(cfg.reward) != sorted(cfg.reference):
            out.append("placement.reference: separation scores reward and reference in one "
                       "scorer process; give them the same devices or leave one empty")
        if len(cfg.actor) > 1:
            out.append(f"placement.actor: the separation trainer is one process on one device "
                       f"for now, got {cfg.actor}")
    return out


def validate(p: Placement) -> list[str]:
    """Conflicts of a placement, all of them: roles missing, devices out of range or
    shared between a training runtime and anything else."""
    out = []
    roles = {q.role for q in p.processes}
    need = {"worker"} if p.strategy == "flattening" else {"trainer", "generator", "scorer"}
    out += [f"placement: no {r} process" for r in sorted(need - roles)]
    ids = [q.node_id for q in p.processes]
    out += [f"placement: node id {i!r} used twice" for i in sorted({i for i in ids
                                                                     if ids.count(i) > 1})]
    for q in p.processes:
        bad = [d for d in q.devices if not 0 <= d < p.num_devices]
        if bad or not q.devices:
            out.append(f"placement: {q.node_id} on devices {list(q.devices)}, "
                       f"accepted 0..{p.num_devices - 1}")
    if p.strategy == "separation" and p.num_devices > 1:
        train = {d for q in p.processes if q.runtime == TRAIN for d in q.devices}
        for q in p.processes:
            shared = sorted(train & set(q.devices)) if q.runtime == INFER else []
            if shared:
                out.append(f"placement: {q.node_id} ({q.role}) shares device(s) {shared} with "
                           "the trainer; separation keeps training and inference apart")
    return out
