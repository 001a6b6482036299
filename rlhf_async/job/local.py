"""`run_job`: a job on this machine, end to end (SFT -> reward model -> RL -> evaluation)
with the strategy its placement names (`strategies.registry`).

The CLI's `run` subcommand calls `run_job(config_path, overrides)`; `ConfigError` (and its
subclass `PlacementError`) carry every problem in one message for it to print.
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
import time
from contextlib import nullcontext
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Literal

from transformers.utils import logging as hf_logging

from rlhf_async.config import (
    ConfigError,
    JobConfig,
    collective_backend,
    config_from_dict,
    describe_sized,
    load_config,
    to_dict,
)
from rlhf_async.engines.process_group import Launch, env_group, launched
from rlhf_async.job.launched import Share, adopt_world, follow, leading, lock_step_only
from rlhf_async.job.lock import hold_run_dir
from rlhf_async.job.on_ray import run_ranks
from rlhf_async.job.signals import on_stop_signals
from rlhf_async.job.summary import format_summary, reward_model_used, step_totals
from rlhf_async.log import get_logger, log_to_file
from rlhf_async.metrics import truncate_metrics
from rlhf_async.modeling.env_calls import EnvError
from rlhf_async.modeling.models import ScalarHeadModel
from rlhf_async.ops.plotting import plot_metrics
from rlhf_async.ops.reporting import Reporter
from rlhf_async.planning.planner import prepare_run
from rlhf_async.rl.checkpoint import (
    Checkpoint,
    CheckpointError,
    list_checkpoints,
    load_latest,
    resume_hint,
)
from rlhf_async.runtime.cpu import set_cpu_compute
from rlhf_async.runtime.launcher import warm_fork_server
from rlhf_async.runtime.ray_cluster import ray_cluster
from rlhf_async.strategies.base import JobStopped, RunResult, Strategy, UserCodeFailed
from rlhf_async.strategies.placement import Placement, with_engines
from rlhf_async.strategies.registry import STRATEGIES
from rlhf_async.task import Task, check_reachable, make_task, task_preload
from rlhf_async.task.artefacts import Artefacts, load_reward, load_sft, prepare_artefacts
from rlhf_async.task.evaluation import evaluate
from rlhf_async.task.rewards.remote_reward import RewardServerError
from rlhf_async.task.rewards.teacher import check_teacher

log = get_logger(component="job")


def run_dir_of(cfg: JobConfig) -> Path:
    """run.output_dir/run.name (a UTC timestamp when run.name is empty)."""
    name = cfg.run.name or datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return Path(cfg.run.output_dir) / name


def run(cfg: JobConfig, out: IO[str] | None = None, run_dir: Path | None = None,
        own_process: bool = False) -> dict:
    """Run the whole job for a validated config; returns the summary (also summary.json).
    With `run_dir`, continue that run from its newest good checkpoint. `own_process`: the
    caller (the CLI) exits when this returns, so a stop signal after training is ignored.
    Started by a launcher (torchrun, srun: RANK, WORLD_SIZE, ... set), this process is one
    rank of a lock-step job (job/launched.py)."""
    hf_logging.disable_progress_bar()
    launch = launched()
    if launch is not None:
        cfg = adopt_world(cfg, launch)
    cfg, placement = prepare_run(cfg)  # auto resolved; every problem before any work
    if cfg.placement.device == "cpu":
        set_cpu_compute(cfg.placement.cpu_threads, cfg.placement.flush_denormal)
    task = make_task(cfg)  # a bad prompts file or reward function stops the run here
    check_reachable(cfg)  # an environment server's app or URL, before any process starts
    target = run_dir_of(cfg) if run_dir is None else run_dir
    resume = run_dir is not None
    mode = launch_mode(cfg, STRATEGIES[placement.strategy], launch)
    if mode == "ray-ranks":
        return _ranks_on_ray(cfg, target, resume, out)
    if mode == "launched-rank":
        assert launch is not None
        with env_group(collective_backend(cfg.placement.device), launch):
            if launch.rank == 0:
                with leading() as share, hold_run_dir(target) as held:
                    return _run_held(cfg, placement, task, out, held, resume, own_process, share)
            return _follow_rank(cfg, placement, launch.rank)
    strategy = STRATEGIES[placement.strategy]
    nodes_here = not strategy.lock_step and cfg.placement.launcher == "local"
    ranks_here = strategy.lock_step and cfg.placement.devices > 1  # (on Ray: returned above)
    # importing while SFT and the reward model train; not for a run that is over (the
    # server would hold our stdout open until its imports are done)
    if cfg.runtime.node_start == "fork" and (nodes_here or ranks_here) and \
            not (resume and _finished(target)):
        warm_fork_server((strategy.fork_preload if nodes_here else ()) + task_preload(cfg))
    fresh = not resume and not target.exists()
    try:
        # one job per run directory, held before anything is written there (job/lock.py);
        # on Ray, a cluster that cannot hold the placement stops the job before SFT
        with hold_run_dir(target) as held, \
                ray_cluster(cfg) if cfg.placement.launcher == "ray" else nullcontext():
            return _run_held(cfg, placement, task, out, held, resume, own_process)
    except (ConfigError, EnvError) as e:
        if fresh:
            _discard_unstarted(target)
        if isinstance(e, EnvError | RewardServerError) and target.exists():
            what = "; ".join(e.problems) if isinstance(e, ConfigError) else str(e)
            raise UserCodeFailed(f"{what}; {resume_hint(target)}") from e
        if isinstance(e, EnvError):  # before any step: nothing kept, nothing to resume
            raise UserCodeFailed(str(e)) from e
        raise


LaunchMode = Literal["here", "ray-ranks", "launched-rank"]


def launch_mode(cfg: JobConfig, strategy: Strategy, launch: Launch | None) -> LaunchMode:
    """How this process runs the job, decided once: `launched-rank`, one rank of a job a
    launcher (torchrun, srun) started; `ray-ranks`, a lock-step job whose ranks this
    process starts on Ray; `here`, everything from this process (a lock-step job's ranks,
    or Separation's node processes, locally or as Ray actors)."""
    if launch is not None:
        lock_step_only(strategy.name, strategy.lock_step)
        return "launched-rank"
    if strategy.lock_step and cfg.placement.launcher == "ray":
        return "ray-ranks"
    return "here"


def _ranks_on_ray(cfg: JobConfig, run_dir: Path, resume: bool, out: IO[str] | None) -> dict:
    """A lock-step job whose ranks Ray starts (job/on_ray.py); rank 0's summary, or where
    the job stopped on request."""
    stopped = run_ranks(cfg, run_dir, resume)
    summary = _finished(run_dir)
    if summary is None:
        return _stopped(run_dir, JobStopped(stopped or "rank 0 stopped"), out)
    if out is not None:
        out.write(format_summary(summary))
        out.flush()
    return summary


def _discard_unstarted(run_dir: Path) -> None:
    """A user's mistake that shows only at first use (a reward function's first calls, in
    the initial evaluation or the first step): the run directory this job made holds no
    step's record and no checkpoint; it goes, so the mistake leaves nothing behind."""
    metrics = run_dir / "metrics.jsonl"
    if (metrics.exists() and metrics.stat().st_size) or \
            list_checkpoints(run_dir / "checkpoints"):
        return
    log.info("run directory removed: the job stopped on a configuration error before "
             "training", run_dir=str(run_dir))
    shutil.rmtree(run_dir, ignore_errors=True)


def _follow_rank(cfg: JobConfig, placement: Placement, rank: int) -> dict:
    """A launched rank other than 0: RL with rank 0's artefacts, then nothing to write."""
    got = follow()
    if got is None:
        return {"rank": rank, "nothing_to_run": True}
    art, start_step, run_dir = got
    try:
        STRATEGIES[cfg.placement.strategy].run(cfg, placement, art, run_dir, start_step)
    except JobStopped as e:
        return {"run_dir": str(run_dir), "rank": rank, "stopped": e.reason}
    return {"run_dir": str(run_dir), "rank": rank}


def _check_strategy(ck: Checkpoint | None, strategy: str) -> None:
    """A trainer process's checkpoint (a strategy that runs its own processes) and a
    lock-step rank's hold different state: a run continues under a strategy of the family
    (`Strategy.lock_step`) that wrote its checkpoint; one written by a strategy not
    registered here continues under that strategy only."""
    written = None if ck is None else ck.meta.get("strategy")
    if written is None or written == strategy or (
            written in STRATEGIES and strategy in STRATEGIES
            and STRATEGIES[written].lock_step == STRATEGIES[strategy].lock_step):
        return
    raise CheckpointError(f"{ck.path if ck else ''} was written by placement.strategy = "
                          f"{written!r}; this run has {strategy!r}, which cannot continue "
                          f"from it: set placement.strategy back in the run's config.json")


def _run_held(cfg: JobConfig, placement: Placement, task: Task, out: IO[str] | None,
              run_dir: Path, resume: bool, own_process: bool,
              share: Share | None = None) -> dict:
    """The job in its held directory, its log records in RUN_DIR/logs/job.log (JSON), and
    first, on the console (unless run.progress = false), what `auto` decided and why."""
    with log_to_file(run_dir / "logs" / "job.log", decisions=cfg.run.progress):
        if placement.reason:
            log.info("auto placement", component="placement", why=placement.reason,
                     console=f"placement.strategy = auto chose {placement.strategy}: "
                             f"{placement.reason}")
        if placement.engine_reason:
            log.info("auto engine", component="engine", backend=cfg.generation.backend,
                     why=placement.engine_reason, console=placement.engine_reason)
        return _run_logged(cfg, placement, task, out, run_dir, resume, own_process, share)


def _run_logged(cfg: JobConfig, placement: Placement, task: Task, out: IO[str] | None,
                run_dir: Path, resume: bool, own_process: bool,
                share: Share | None = None) -> dict:
    t_start = time.perf_counter()
    start_step = 0
    if not resume:  # a fresh run
        if list_checkpoints(run_dir / "checkpoints") or (run_dir / "metrics.jsonl").exists():
            raise ConfigError([f"run.name: {run_dir} already holds a run; continue it with "
                               f"`rlhf-async resume {run_dir}` or choose another run.name"])
    else:  # resume: the newest good checkpoint decides where the run continues
        finished = _finished(run_dir)
        if finished is not None:
            if out is not None:
                out.write(f"{run_dir} already finished ({cfg.train.steps} steps); its "
                          f"summary is {run_dir / 'summary.json'}: nothing to resume\n")
            return finished
        ck = load_latest(run_dir / "checkpoints")
        start_step = 0 if ck is None else ck.step
        _check_strategy(ck, cfg.placement.strategy)
        truncate_metrics(run_dir, start_step)
        if ck is None:  # stopped or killed before its first checkpoint: start it again
            log.warning("no checkpoint: resuming from step 0", run_dir=str(run_dir))
        else:
            log.info("resuming", run_dir=str(run_dir), step=start_step,
                     checkpoint=str(ck.path))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))

    t0 = time.perf_counter()
    try:
        # before RL there is nothing to checkpoint; a raise that library code swallows comes again
        with on_stop_signals(_stop_now, again_s=0.5):
            check_teacher(cfg)  # before the SFT stage: a teacher on another vocabulary
            art = prepare_artefacts(cfg, task)
            if share is not None:  # the launched job's other ranks start from these
                share(art, start_step, run_dir)
            t_pre = time.perf_counter() - t0
            reward_model = load_reward(art)
            sft_eval = evaluate(load_sft(art.sft_dir), reward_model, task, cfg,
                                "sft" if art.sft_stats else "initial")
        log.info("sft policy evaluated", **sft_eval)
        (run_dir / "placement.txt").write_text(placement.table() + "\n")
        reporter = Reporter.start(run_dir, cfg.run.report_to, to_dict(cfg))
        try:  # the strategy handles stop signals itself: step finished, checkpoint written
            result = STRATEGIES[cfg.placement.strategy].run(cfg, placement, art, run_dir,
                                                            start_step)
        finally:
            if reporter is not None:
                reporter.close()
    except JobStopped as e:
        return _stopped(run_dir, e, out)
    # trained and saved: the summary takes seconds, and a stop now changes nothing (in
    # the CLI's process the handler stays until it exits: the job is done)
    with on_stop_signals(_finish_first, restore=not own_process):
        return _summarize(cfg, task, out, run_dir, art, result, reward_model, sft_eval,
                          t_start, t_pre, start_step)


def _summarize(cfg: JobConfig, task: Task, out: IO[str] | None, run_dir: Path,
               art: Artefacts, result: RunResult, reward_model: ScalarHeadModel | None,
               sft_eval: dict, t_start: float, t_pre: float, start_step: int) -> dict:
    final_eval = evaluate(load_sft(result.policy_dir), reward_model, task, cfg, "final")
    log.info("final policy evaluated", **final_eval)
    if cfg.run.plot:
        plot_metrics(result.metrics_path, run_dir / "metrics.png",
                     f"{cfg.algo.name} on {cfg.task.name} (seed {cfg.run.seed})",
                     rule_reward=task.rule_reward)
    totals, trained_now = step_totals(result.metrics_path, start_step)
    summary = {
        "run_dir": str(run_dir), "algo": cfg.algo.name, "seed": cfg.run.seed,
        "strategy": cfg.placement.strategy, "devices": cfg.placement.devices,
        "sft_hidden_score": sft_eval["hidden_score"],
        "final_hidden_score": final_eval["hidden_score"],
        "sft_reward": sft_eval["reward"], "final_reward": final_eval["reward"],
        "eval_prompts": final_eval["prompts"], "eval_samples": cfg.run.eval_samples,
        "task": cfg.task.name, "reward_model": reward_model_used(cfg.reward_model.path, art),
        "has_rule": task.has_rule,
        "rm_accuracy": art.rm_stats.get("rm_accuracy"),
        "rm_label_accuracy": art.rm_stats.get("rm_label_accuracy"),
        "pretrain_seconds": t_pre, "rl_seconds": result.seconds,
        "rl_samples_per_s": trained_now / result.seconds,
        "wall_seconds": time.perf_counter() - t_start, **totals,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if out is not None:
        out.write(format_summary(summary))
        out.flush()
    return summary


def _stop_now(signum: int, _frame: object) -> None:
    raise JobStopped(signal.Signals(signum).name)


def _finish_first(signum: int, _frame: object) -> None:
    log.warning("stop requested after training: writing the summary first",
                signal=signal.Signals(signum).name)


def _finished(run_dir: Path) -> dict | None:
    """The summary of a run that ran to its end (written last, after the final policy)."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return summary if isinstance(summary, dict) and "final_hidden_score" in summary else None


def _stopped(run_dir: Path, e: JobStopped, out: IO[str] | None) -> dict:
    """A run stopped on request: where its checkpoint is, and the command that goes on."""
    ck = load_latest(run_dir / "checkpoints")
    where = (f"checkpoint of step {ck.step}: {ck.path}" if ck is not None else
             "no checkpoint yet (resume starts at step 0)")
    log.info("run stopped", reason=e.reason, run_dir=str(run_dir),
             step=None if ck is None else ck.step)
    if out is not None:
        out.write(f"stopped ({e.reason}); {where}\ncontinue with: rlhf-async resume "
                  f"{run_dir}\n")
        out.flush()
    return {"run_dir": str(run_dir), "stopped": e.reason,
            "step": None if ck is None else ck.step}


def resume_job(run_dir: str | Path) -> int:
    """Continue RUN_DIR with the config it was started with; 0 on success."""
    run_dir = Path(run_dir)
    try:
        data = json.loads((run_dir / "config.json").read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{run_dir} is not a run directory (no config.json)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {run_dir / 'config.json'}: {e}") from None
    run(config_from_dict(data), sys.stdout, run_dir=run_dir, own_process=True)
    return 0


def run_job(config_path: str | None, overrides: list[str], base_dir: str | None = None,
            dry_run: bool = False) -> int:
    """Load the config (TOML file and/or dotted overrides; relative paths from `base_dir`,
    else the working directory) and run the job; 0 on success. Raises ConfigError (one
    message listing every problem) for bad configuration. `dry_run`: validate and place,
    print the processes that would run, start nothing and write nothing."""
    return run_config(load_config(config_path, overrides, base_dir=base_dir), dry_run)


def run_config(cfg: JobConfig, dry_run: bool = False) -> int:
    """`run_job` for a loaded config (the CLI loads it before torch is imported)."""
    if dry_run:
        sys.stdout.write(dry_run_report(cfg))
        return 0
    run(cfg, sys.stdout, own_process=True)
    return 0


def dry_run_report(cfg: JobConfig) -> str:
    """Every check `run` makes before it starts (config, placement, what the runner
    executes, the task's inputs), then the placement it would run, as text."""
    cfg, placement = prepare_run(cfg)
    make_task(cfg)
    check_reachable(cfg)
    placement = with_engines(placement, cfg.train.backend, cfg.generation.backend)
    sized = describe_sized(cfg)  # the values sized to model.path, and where each came from
    return (f"{placement.table()}\n\n" + (f"{sized}\n" if sized else "")
            + f"run directory: {run_dir_of(cfg)}\n"
            "dry run: every check passed; nothing was started or written\n")
