"""The planner: `auto` placement, memory validation, simulation and calibration (what it
prices with: `machine.py`; the prices: `costmodel.py` and each strategy's `Pricing`).

    prepare_run(cfg)             -> (JobConfig, Placement): auto resolved, checked for running
    plan_job(cfg)                -> Placement (auto resolved, predicted memory checked)
    resolve_auto(cfg)            -> JobConfig with the predicted fastest feasible strategy
    simulate(gpu, models, sizes) -> predicted step time and memory per strategy
    calibrate(cfg, out)          -> measures this machine, writes a calibration JSON
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from rlhf_async.config import (
    AlgoConfig,
    GenerationConfig,
    JobConfig,
    PlacementConfig,
    TrainConfig,
)
from rlhf_async.config.presets import resolve
from rlhf_async.config.reference import overrides
from rlhf_async.engines import ENGINES, engine_choice, engine_name_problems, extra_problems
from rlhf_async.log import get_logger
from rlhf_async.planning.costmodel import (
    DEVICES,
    LLAMA,
    Calibration,
    DeviceSpec,
    GiB,
    ModelShape,
    Prediction,
    Workload,
    kv_cache_room,
    predict,
)
from rlhf_async.planning.machine import device_peak, machine, shape_of, workload_of
from rlhf_async.rl.registry import name_problems
from rlhf_async.strategies.placement import (
    Placement,
    PlacementError,
    override_int,
    parse_overrides,
    with_reason,
)
from rlhf_async.strategies.registry import (
    AUTO,
    STRATEGIES,
    build_placement,
    feature_problems,
    runnable_placement,
    runner_problems,
)
from rlhf_async.task.adapters import adapter_problems

log = get_logger(component="planner")
Candidate = tuple[PlacementConfig, Placement | None, Prediction | None, str]


def predictions(cfg: JobConfig) -> dict[str, Candidate]:
    """Every candidate strategy's placement config, placement and prediction (or why it
    cannot be placed, as a plan or by this build's runners: `auto` never picks what `run`
    would refuse): the fastest of the layouts the strategy compares (`Pricing.layouts`:
    Separation's stage sizes, unless the user pinned them), else its preset."""
    dev, cal = machine(cfg)
    shape, work = shape_of(cfg), workload_of(cfg)

    def price(p: Placement) -> tuple[float, bool]:
        pred = predict(p, shape, work, dev, cal)
        return pred.step_s, pred.feasible

    out: dict[str, Candidate] = {}
    for name, strategy in STRATEGIES.items():
        job = dataclasses.replace(cfg, placement=dataclasses.replace(cfg.placement,
                                                                     strategy=name))
        found = fastest(job, strategy.pricing.layouts(job.placement), price)
        if found is not None:
            job, p = found
        else:
            try:
                p = runnable_placement(job)
            except PlacementError as e:
                out[name] = (job.placement, None, None, "; ".join(e.problems))
                continue
        out[name] = (job.placement, p, predict(p, shape, work, dev, cal), "")
    return out


def fastest(cfg: JobConfig, layouts: list[PlacementConfig],
            price: Callable[[Placement], tuple[float, bool]]) -> tuple[JobConfig, Placement] | None:
    """The job with the layout whose predicted step (`price`: seconds and whether it fits
    in memory) is the shortest among those `run` accepts; None when none runs. Ties keep
    the earlier layout (Separation's: the fewest trainer ranks, less gradient traffic)."""
    best: tuple[float, JobConfig, Placement] | None = None
    for pc in layouts:
        job = dataclasses.replace(cfg, placement=pc)
        try:
            p = runnable_placement(job)
        except PlacementError:
            continue
        step, fits = price(p)
        if fits and (best is None or step < best[0] * (1 - 1e-9)):
            best = (step, job, p)
    return None if best is None else (best[1], best[2])


def _choose(cfg: JobConfig) -> tuple[PlacementConfig, Placement, str]:
    preds = predictions(cfg)
    ok = {n: (pc, p, pr) for n, (pc, p, pr, _) in preds.items()
          if p is not None and pr is not None and pr.feasible}
    if not ok:
        raise PlacementError([f"placement.strategy: auto found no feasible placement: {n}: "
                              f"{why or '; '.join(pr.notes if pr else [])}"
                              for n, (_, _, pr, why) in preds.items()])
    best = min(ok, key=lambda n: ok[n][2].step_s)
    times = ", ".join(f"{n} {pr.step_s * 1e3:.1f} ms" + (f" ({lay})" if (lay := _layout(p))
                                                        else "")
                      for n, (_, p, pr) in ok.items())
    skipped = "".join(f"; {n} not possible ({why or 'infeasible'})"
                      for n, (_, p, pr, why) in preds.items() if n not in ok)
    reason = (f"predicted step time {times} (max_staleness {cfg.algo.max_staleness}); "
              f"{best} is the fastest feasible{skipped}")
    pc, placement, _ = ok[best]
    return pc, with_reason(placement, reason), reason


def choose(cfg: JobConfig) -> tuple[Placement, str]:
    """The predicted fastest feasible placement and a sentence saying why."""
    _, placement, reason = _choose(cfg)
    return placement, reason


def resolve_auto(cfg: JobConfig) -> JobConfig:
    """cfg with `placement.strategy = auto` replaced by the planner's choice (logged): the
    strategy and the layout it chose (Separation's stage sizes), so the saved config
    (and a resume) runs the same layout."""
    return _resolved(cfg)[0]


def _resolved(cfg: JobConfig) -> tuple[JobConfig, str]:
    pc, placement, reason = _choose(cfg)
    log.info("auto placement", strategy=placement.strategy, reason=reason)
    return dataclasses.replace(cfg, placement=pc), reason


def prepare_run(cfg: JobConfig) -> tuple[JobConfig, Placement]:
    """Before anything starts: `auto` resolved to a strategy (logged with its reason), and
    the placement checked as a plan (memory included) and for what this build's runner
    executes, every problem in one PlacementError."""
    # the names the config layer cannot check: the engines' first (nothing else can be asked
    # of an engine no registry holds), the algorithm's with every other problem
    algo_names = name_problems(resolve(cfg.algo))
    if engine_names := engine_name_problems(cfg):
        raise PlacementError(engine_names + algo_names)
    # the environment adapters' own checks (the config layer cannot see them), next:
    # pricing reads the prompts an adapter gives
    adapters = adapter_problems(cfg)
    if adapters:
        raise PlacementError(adapters + algo_names)
    auto = cfg.placement.strategy == AUTO
    cfg, strategy_why = _resolved(cfg) if auto else (cfg, "")
    # the generation engine chosen once, here: every process of the job reads this one
    engine, why = engine_choice(cfg)
    chose = f"generation.backend = auto chose {engine}: {why}" if why else ""
    cfg = dataclasses.replace(cfg, generation=dataclasses.replace(
        cfg.generation, backend=engine))
    placement, _, problems = _plan(cfg)
    if placement is not None:
        placement = dataclasses.replace(placement, reason=strategy_why, engine_reason=chose)
    problems += feature_problems(cfg, auto)
    if placement is not None:
        problems += [p for p in runner_problems(cfg, placement) if p not in problems]
    problems += extra_problems(cfg)
    problems += algo_names
    if problems or placement is None:
        raise PlacementError(problems)
    return _with_peak(cfg, placement), placement


def _with_peak(cfg: JobConfig, placement: Placement) -> JobConfig:
    """placement.peak_flops resolved (what the run's mfu/* metrics divide by), logged."""
    dtype = placement.precision().name("actor")
    peak, source = device_peak(cfg, dtype)
    if not cfg.placement.peak_flops:
        log.info("device peak", flops=peak, source=source)
    return dataclasses.replace(cfg, placement=dataclasses.replace(cfg.placement,
                                                                   peak_flops=peak))


def plan_job(cfg: JobConfig) -> tuple[Placement, Prediction]:
    """The placement a run would use, its prediction, and every problem in one error:
    the placement's own conflicts, predicted memory over the device budget, and engine
    names no registry holds (a plan may be for another machine: extras are not asked)."""
    placement, pred, problems = _plan(cfg)
    problems = engine_name_problems(cfg) + problems
    if problems or placement is None or pred is None:
        raise PlacementError(problems)
    return placement, pred


def _plan(cfg: JobConfig) -> tuple[Placement | None, Prediction | None, list[str]]:
    problems: list[str] = []
    found: Placement | None
    if cfg.placement.strategy == AUTO:
        found, _ = choose(cfg)
    else:
        found, problems = build_placement(cfg.placement, cfg.algo.name)
    if found is None:
        return None, None, problems
    dev, cal = machine(cfg)
    shape, work = shape_of(cfg), workload_of(cfg)
    pred = predict(found, shape, work, dev, cal)
    if pred.zero3 and (cfg.train.backend, cfg.train.zero_stage) != ("deepspeed", 3):
        pred.notes.append(
            f"the training copies fit only ZeRO-3-sharded (this prediction shards them), but "
            f"train.backend = {cfg.train.backend!r} holds them whole on every device: set "
            "train.backend=deepspeed train.zero_stage=3")
    problems += [f"placement: predicted memory over budget on device {d}: {b / GiB:.3g} GiB "
                 f"> {0.9 * dev.memory / GiB:.3g} GiB (placement.memory_gb or the device's "
                 f"memory){_activation_hint(pred.activations.get(d, 0.0))}"
                 for d, b in pred.memory.items() if b > 0.9 * dev.memory]
    # the resident models alone can fit while not one sequence's KV cache does (a huge
    # generation.max_new_tokens): generation would then grow until the machine swaps
    kv_row, free = kv_cache_room(found, shape, work, dev, pred.resident)
    if 0 < free < kv_row:
        problems.append(
            f"generation.max_new_tokens: {cfg.generation.max_new_tokens} new tokens after a "
            f"{work.prompt_len}-token prompt need a predicted {kv_row / GiB:.3g} GiB of KV "
            f"cache for one sequence, over the {free / GiB:.3g} GiB the models leave on a "
            "generating device (placement.memory_gb or the device's memory); accepted: a "
            "smaller generation.max_new_tokens")
    return found, pred, problems


def _activation_hint(acts: float) -> str:
    if not acts:
        return ""
    return (f", of which {acts / GiB:.3g} GiB are a training micro-batch's activations "
            "(a larger train.grad_accum or train.gradient_checkpointing = true lowers them)")


def format_prediction(pred: Prediction, dev: DeviceSpec, cal: Calibration) -> str:
    ph = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in pred.phases.items())
    lines = [f"predicted step {pred.step_s * 1e3:.1f} ms ({ph})",
             (f"predicted peak memory {pred.peak_memory / GiB:.3g} GiB per device "
             f"(budget {0.9 * dev.memory / GiB:.3g} GiB on {dev.name}; training "
             f"activations {max(pred.activations.values(), default=0.0) / GiB:.3g} GiB)"),
             f"calibration: {cal.source}"]
    return "\n".join(lines + [f"note: {n}" for n in pred.notes])


# ---- simulation --------------------------------------------------------------------------

SIM_WORK = Workload(samples=1024, prompt_len=512, gen_len=480, epochs=1, minibatches=4,
                    checkpointing=True)
SIM_GRAD_ACCUM = (1, 2, 4, 8, 16)  # micro-batches per minibatch the simulation may use


def _spanning() -> str:
    """The first registered generation engine that runs tensor-parallel."""
    return next(n for n, e in ENGINES.items() if e.tensor_parallel)


def sim_job(placement: PlacementConfig, work: Workload) -> JobConfig:
    """The job `plan --simulate` prices: PPO on `work` (one response per prompt) with this
    placement, as `run` would get it (tensor-parallel generators on the first registered engine
    that spans devices)."""
    over, _ = parse_overrides(placement)
    gen_tp = override_int(over, "shadow_actor", "tensor_parallel", 1)
    return JobConfig(
        algo=AlgoConfig(name="ppo", group_size=1, max_staleness=work.max_staleness),
        generation=GenerationConfig(max_new_tokens=work.gen_len,
                                    backend=_spanning() if gen_tp > 1 else
                                    GenerationConfig().backend),
        train=TrainConfig(prompts_per_step=work.samples, epochs=work.epochs,
                          minibatches=work.minibatches, grad_accum=work.grad_accum,
                          gradient_checkpointing=work.checkpointing),
        placement=placement)


def _sim_candidates(n: int) -> dict[str, list[PlacementConfig]]:
    """Each strategy's layouts on n GPUs: its grid (`Pricing.grid`: Separation's device
    splits and tensor-parallel sizes), else its preset."""
    out = {}
    for name, strategy in STRATEGIES.items():
        base = PlacementConfig(strategy=name, device="cuda", devices=n)
        out[name] = strategy.pricing.grid(base) or [base]
    return out


def sim_options(n: int, work: Workload) -> dict[str, tuple[list[tuple[JobConfig, Placement]],
                                                           list[str]]]:
    """Per strategy, the candidate layouts on n GPUs that `run` would accept (the plan's
    own checks and this build's runners', `runnable_placement`), and the problems of those
    it would refuse."""
    out = {}
    for strategy, configs in _sim_candidates(n).items():
        ok, refused = [], []
        for pc in configs:
            job = sim_job(pc, work)
            try:
                ok.append((job, runnable_placement(job)))
            except PlacementError as e:
                refused += [p for p in e.problems if p not in refused]
        out[strategy] = (ok, refused)
    return out


def simulate(gpu: str, models: list[str], sizes: list[int], work: Workload = SIM_WORK,
             cal: Calibration | None = None) -> list[dict]:
    """One row per (model, devices, strategy): best predicted step time and memory among
    the layouts `run` accepts, with the placement and training overrides that run it."""
    dev, cal = DEVICES[gpu], cal or Calibration()
    rows = []
    works = {k: dataclasses.replace(work, max_staleness=k) for k in (0, 1)}
    options = {(n, k): sim_options(n, w) for n in sizes for k, w in works.items()}
    for name in models:
        for n in sizes:
            for k, w in works.items():
                for strategy, (runnable, refused) in options[(n, k)].items():
                    lock_step = STRATEGIES[strategy].lock_step
                    if k and lock_step:
                        continue  # lock-step strategies do not overlap: k changes nothing
                    label = strategy if lock_step else f"{strategy} k={k}"
                    rows.append({"model": name, "gpus": n, "strategy": label,
                                 "name": strategy, "k": k,
                                 **_best(runnable, refused, LLAMA[name], w, dev, cal)})
    return rows


def _best(runnable: list[tuple[JobConfig, Placement]], refused: list[str], shape: ModelShape,
          work: Workload, dev: DeviceSpec, cal: Calibration) -> dict:
    """The fastest feasible of the runnable layouts, each with the smallest
    train.grad_accum (of 1-16) whose activations fit; else the fastest, marked OOM. Its
    overrides name the engine the price assumes (`priced_job`); a row whose engine `run`
    would refuse is refused, not proposed."""
    if not runnable:
        return {"step_s": None, "phases": {}, "memory_gib": 0.0, "feasible": False,
                "runnable": False, "notes": refused, "layout": "", "overrides": []}
    preds = []
    for job, p in runnable:
        for accum in SIM_GRAD_ACCUM:
            w = dataclasses.replace(work, grad_accum=accum)
            preds.append((predict(p, shape, w, dev, cal), job, p, accum))
            if preds[-1][0].feasible:
                break
    feasible = [x for x in preds if x[0].feasible] or preds
    pred, job, p, accum = min(feasible, key=lambda x: x[0].step_s)
    job = priced_job(job, pred, accum)
    try:
        runnable_placement(job)
    except PlacementError as e:  # the engine the price needs is one `run` refuses here
        return _best([], e.problems, shape, work, dev, cal)
    layout = _layout(p) + (f"; grad_accum {accum}" if accum > 1 else "")
    return {"step_s": pred.step_s, "phases": pred.phases, "memory_gib": pred.peak_memory / GiB,
            "feasible": pred.feasible, "runnable": True, "notes": pred.notes,
            "layout": layout.strip("; "), "overrides": overrides(job)}


def priced_job(job: JobConfig, pred: Prediction, accum: int) -> JobConfig:
    """`job` as `pred` priced it: with its train.grad_accum, and on DeepSpeed ZeRO-3 when
    the prediction shards the training copies (the torch engine would hold them whole)."""
    train = dataclasses.replace(job.train, grad_accum=accum)
    if pred.zero3:
        train = dataclasses.replace(train, backend="deepspeed", zero_stage=3)
    return dataclasses.replace(job, train=train)


def _layout(p: Placement) -> str:
    """The stage sizes of a strategy whose stages have sizes (not a lock-step one)."""
    if STRATEGIES[p.strategy].lock_step:
        return ""
    parts = []
    for m in p.models:
        if m.model in ("actor", "shadow_actor", "reward"):  # reference: as reward
            tp = f" tp{m.tensor_parallel}" if m.tensor_parallel > 1 else ""
            parts.append(f"{m.model} {len(m.devices)}{tp}")
    return ", ".join(parts)
