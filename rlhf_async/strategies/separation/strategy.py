"""Separation as a strategy: trainer (actor, critic) apart from the inference side, shadow
actors in generator processes and reward + reference in scorer processes; the trainer
broadcasts new weights to the shadows (`runner.py` runs it on this machine, `on_ray.py` on a
Ray cluster)."""

from __future__ import annotations

from pathlib import Path

from rlhf_async.config import JobConfig, PlacementConfig
from rlhf_async.config.presets import Recipe
from rlhf_async.strategies.base import Overrides, RunResult, Strategy
from rlhf_async.strategies.placement import (
    INFER,
    TRAIN,
    Placement,
    ProcessPlacement,
    engine_problems,
    model_placement,
    override_int,
    ranges,
)
from rlhf_async.strategies.pricing import Pricing
from rlhf_async.strategies.separation import pricing
from rlhf_async.strategies.separation.on_ray import run as run_on_ray
from rlhf_async.strategies.separation.runner import NODE_MODULES
from rlhf_async.strategies.separation.runner import run as run_here
from rlhf_async.strategies.separation.startup import generator_ranks
from rlhf_async.task.artefacts import Artefacts


def trainer_id(rank: int) -> str:
    """Node id of trainer rank `rank`: "trainer" for rank 0, then trainer1, trainer2, ..."""
    return "trainer" if rank == 0 else f"trainer{rank}"


def _spread(devices: list[int], replicas: int) -> list[tuple[int, ...]]:
    """Replica i gets every replicas-th device starting at i (or shares one when fewer)."""
    if len(devices) >= replicas:
        return [tuple(devices[i::replicas]) for i in range(replicas)]
    return [(devices[i % len(devices)],) for i in range(replicas)]


def preset(cfg: PlacementConfig, recipe: Recipe, over: Overrides) -> Placement:
    """Trainer (actor + critic) apart from the inference side: shadow actors and scorers.

    Defaults: the trainer on device 0 (or one rank per device of placement.actor),
    generators on the other devices, scorers sharing the
    generators' devices (scoring is one forward pass, generation many); one generator and
    one scorer process per device of its group, so every device works. placement.reward
    may put the scorers on the trainer's devices instead, where training leaves them idle
    (a long generation on a small model: bench/README.md, "Scorers beside the trainer").
    """
    n = cfg.devices
    trainer = cfg.actor or [0]
    rest = [d for d in range(n) if d not in trainer] or [0]
    generator = cfg.generator or rest
    scorer = cfg.reward or cfg.reference or generator
    train_models = ("actor", "critic") if recipe.has_critic else ("actor",)
    gens = override_int(over, "shadow_actor", "replicas",
                        cfg.generators or _per_device(generator, over, "shadow_actor"))
    scorers = cfg.scorers or _per_device(scorer, over, "reward")
    # one data-parallel rank per device of the trainer's group; rank 0 is "trainer"
    procs = [ProcessPlacement(trainer_id(r), "trainer", train_models, (d,), TRAIN)
             for r, d in enumerate(trainer)]
    procs += [ProcessPlacement(f"gen{i}", "generator", ("shadow_actor",), d, INFER)
              for i, d in enumerate(_spread(generator, gens))]
    procs += [ProcessPlacement(f"scorer{i}", "scorer", ("reward", "reference"), d, INFER)
              for i, d in enumerate(_spread(scorer, scorers))]
    models = [model_placement(cfg, m, trainer, TRAIN, over) for m in train_models]
    models.append(model_placement(cfg, "shadow_actor", sorted(set(generator)), INFER, over, gens))
    models += [model_placement(cfg, m, sorted(set(scorer)), INFER, over, scorers)
               for m in ("reward", "reference")]
    return Placement("separation", cfg.device, n, tuple(procs), tuple(models))


def _per_device(devices: list[int], over: Overrides, model: str) -> int:
    """Replicas when none are asked for: one per device, or per tensor-parallel group."""
    tp = override_int(over, model, "tensor_parallel", 1)
    return max(1, len(set(devices)) // tp)


def placement_problems(cfg: PlacementConfig, p: Placement) -> list[str]:
    out = []
    if cfg.critic and cfg.actor and sorted(cfg.critic) != sorted(cfg.actor):
        out.append("placement.critic: separation trains actor and critic in one trainer "
                   "process; give them the same devices or leave critic empty")
    if cfg.reward and cfg.reference and sorted(cfg.reward) != sorted(cfg.reference):
        out.append("placement.reference: separation scores reward and reference in one "
                   "scorer process; give them the same devices or leave one empty")
    if p.num_devices > 1:
        train = {d for q in p.processes if q.runtime == TRAIN for d in q.devices}
        for q in p.processes:  # scorers may time-share the trainer's devices; generators
            # may not (their weight broadcast needs a device of their own on GPUs)
            shared = sorted(train & set(q.devices)) if q.role == "generator" else []
            if shared:
                out.append(f"placement: {q.node_id} ({q.role}) shares device(s) {shared} "
                           "with the trainer; separation keeps the trainer and generators "
                           "apart (scorers may share the trainer's devices)")
    return out


def runner_problems(cfg: JobConfig, p: Placement) -> list[str]:
    """Any replica count per model, but a scorer process runs on one GPU and a generator
    on one, or on its tensor-parallel size of them on an engine that spans devices: a
    process that the plan gives more would leave the rest idle, which is refused, not done
    (CPU slots are not pinned: processes there share the cores). The trainer runs one
    data-parallel rank per device of its group, so its models have exactly that many
    replicas."""
    out = engine_problems(p, one_replica_per_device=False)
    ranks = len(p.by_role("trainer"))
    for m in p.models:
        if m.runtime == TRAIN and m.replicas != ranks:
            out.append(f"placement.replicas: {m.model}={m.replicas}; the separation trainer "
                       f"runs one data-parallel rank per device of its group "
                       f"(placement.actor: {ranks} device(s)), so use {ranks}")
    if ranks > 1 and cfg.train.prompts_per_step % ranks:
        out.append(f"train.prompts_per_step: {cfg.train.prompts_per_step} must divide evenly "
                   f"over the {ranks} trainer ranks (placement.actor)")
    if cfg.algo.dynamic_sampling:  # the trainer would need the Driver to dispatch refills
        out.append("algo.dynamic_sampling: runs under Flattening and Interleaving in this "
                   "build; set placement.strategy = 'flattening' or 'interleaving', or "
                   "algo.dynamic_sampling = false")
    if cfg.generation.dtype:
        out.append(f"generation.dtype: {cfg.generation.dtype!r} is for Flattening and "
                   "Interleaving, where the actor generates; Separation's generators hold "
                   f"the shadow actor: placement.dtype = ['shadow_actor={cfg.generation.dtype}']")
    tp = generator_ranks(p)
    if tp > 1 and cfg.placement.launcher == "ray":
        out.append(f"placement.tensor_parallel: shadow_actor={tp} runs with the local launcher "
                   "only (a Ray bundle gives each node process one GPU); use "
                   "placement.launcher = 'local' or shadow_actor=1")
    if cfg.placement.teacher and cfg.placement.launcher == "ray":
        out.append("placement.teacher: a Ray bundle gives each node process one GPU, so the "
                   "teacher stays on its scorer's; use placement.launcher = 'local' or leave "
                   "placement.teacher empty")
    key = {"generator": "placement.generators", "scorer": "placement.scorers"}
    width = {"generator": tp, "scorer": 1}
    for q in p.processes:
        if q.role in key and len(q.devices) > width[q.role] and p.device_kind == "cuda":
            group = sorted({d for x in p.by_role(q.role) for d in x.devices})
            runs_on = "one" if width[q.role] == 1 else f"{tp} (its tensor-parallel size)"
            out.append(f"{key[q.role]}: {q.node_id} is given devices {ranges(q.devices)} but "
                       f"a {q.role} process runs on {runs_on}; use {key[q.role]} = "
                       f"{len(group) // width[q.role]} (the default: 0) for devices "
                       f"{ranges(tuple(group))}")
            break
    return out


def run(cfg: JobConfig, placement: Placement, art: Artefacts, run_dir: Path,
        start_step: int = 0) -> RunResult:
    """The nodes on this machine, or on a Ray cluster (placement.launcher = ray)."""
    go = run_on_ray if cfg.placement.launcher == "ray" else run_here
    return go(cfg, placement, art, run_dir, start_step)


STRATEGY = Strategy(
    name="separation", short="sep",
    summary="trainer apart from generators (shadow actors) and scorers; weights broadcast",
    roles=("trainer", "generator", "scorer"), preset=preset,
    placement_problems=placement_problems, runner_problems=runner_problems, run=run,
    pricing=Pricing(step=pricing.price, layouts=pricing.layouts, grid=pricing.grid),
    fork_preload=NODE_MODULES, scalable=True, rebalance=True, partial_rollout=True,
    staleness=True)
