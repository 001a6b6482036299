"""The lock-step rank loop that Flattening and Interleaving share.

One process per device (in-process when there is one device): every rank takes its part of
the step's prompts (whole groups), generates, scores, trains with gradients summed over
ranks (gloo on CPU, NCCL on GPU), in order, step after step. The strategies differ only in
how a rank scores its rollouts: that is the `ScorerFactory` each passes in, built once per
rank from the freshly loaded SFT actor (the reference is a copy of it). Rank 0 writes
metrics.jsonl, the checkpoints and the final policy.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from transformers.utils import logging as hf_logging

from rlhf_async.config import JobConfig, collective_backend
from rlhf_async.engines import adopt_engine_lines, engine_lines
from rlhf_async.engines.process_group import exit_rank, free_port, launched, rank_group
from rlhf_async.log import configure_logging, console_settings, get_logger, log_to_file
from rlhf_async.metrics import MetricsWriter, Progress, progress_columns
from rlhf_async.modeling.compiled_decode import choose as choose_decode
from rlhf_async.modeling.env_calls import EnvError
from rlhf_async.modeling.episodes import rollout
from rlhf_async.modeling.flops import Utilization
from rlhf_async.modeling.precision import Precision, check_device
from rlhf_async.modeling.rollout import PromptBatch, RolloutBatch
from rlhf_async.pipeline.training import (
    build_learner,
    load_actor,
    restore_learner_checkpoint,
    save_final_policy,
    save_learner_checkpoint,
    step_record,
)
from rlhf_async.rl.dynamic_sampling import dynamic_sample, refill_prompts
from rlhf_async.rl.learner import Learner
from rlhf_async.runtime.cpu import set_cpu_compute
from rlhf_async.runtime.launcher import adopt, can_fork, fork_server
from rlhf_async.strategies.base import JobStopped, RankFailed, RunResult
from rlhf_async.strategies.colocated import colocated_engine
from rlhf_async.strategies.step_health import NothingTrained, StepHealth
from rlhf_async.strategies.utilization import job_utilization
from rlhf_async.task import Task, make_task, sampling_params
from rlhf_async.task.adapters import adapter_lines, adopt_adapter_lines
from rlhf_async.task.artefacts import Artefacts
from rlhf_async.task.evaluation import StepLogs
from rlhf_async.task.rewards.remote_reward import RewardServerError

log = get_logger(component="lockstep")
Scorer = Callable[[RolloutBatch], RolloutBatch]
# (cfg, artefacts, task, SFT actor, rank, world, device, precision) -> this rank's scorer
ScorerFactory = Callable[[JobConfig, Artefacts, Task, nn.Module, int, int, torch.device,
                          Precision], Scorer]


def device_of(cfg: JobConfig, rank: int) -> torch.device:
    """A rank's device: on GPU the launcher's LOCAL_RANK when a launcher started the job
    (ranks span hosts), else the rank modulo the GPUs here."""
    if cfg.placement.device == "cuda":
        launch = launched()
        local = rank if launch is None else launch.local_rank
        return torch.device("cuda", local % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


class StopRequest:
    """A stop asked of every rank: the parent sets it (SIGTERM, SIGINT), each rank reads
    it at a step boundary, and all ranks agree on it (one tiny all-reduce a step) so that
    they stop after the same step and write one checkpoint together."""

    def __init__(self) -> None:
        self.event = mp.get_context("spawn").Event()
        # every step trained and the policy saved: a stop that came during the final save
        # found nothing left to stop (the run finished)
        self.finished = mp.get_context("spawn").Event()
        self.reason = ""
        self.parent = os.getpid()
        # a rank's parent process at its start: the job's process (spawned), or the fork
        # server, which exits with the job's process (runtime.node_start = fork)
        self.rank_parent = self.parent

    def set(self, reason: str) -> None:
        self.reason = self.reason or reason
        self.event.set()

    def agreed(self, world: int) -> bool:
        if os.getpid() != self.parent and os.getppid() != self.rank_parent:
            os._exit(1)  # the job's process is gone (SIGKILL): nothing to report to
        if world == 1:
            return self.event.is_set()
        # NCCL reduces only tensors on the rank's GPU
        dev = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend() == "nccl" else torch.device("cpu")
        flag = torch.tensor([1.0 if self.event.is_set() else 0.0], device=dev)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def generation_precision(cfg: JobConfig, precision: Precision) -> Precision:
    """What the lock-step loop generates in: the actor generates with its own weights, in
    its own dtype unless `generation.dtype` names another."""
    if not cfg.generation.dtype:
        return precision
    return Precision({**precision.dtypes, "actor": cfg.generation.dtype})


def rank_loop(cfg: JobConfig, art: Artefacts, run_dir: Path, rank: int, world: int,
              start_step: int, make_scorer: ScorerFactory, strategy: str,
              precision: Precision, stop: StopRequest | None = None) -> bool:
    """The hot loop; identical on every rank except what it holds and who writes files.
    True when it ran to the end, False when it stopped on request (checkpoint written)."""
    device = device_of(cfg, rank)
    check_device(precision, device)
    task = make_task(cfg)
    actor = load_actor(art, device)
    # before training: the reference is a copy of the SFT actor
    scorer = make_scorer(cfg, art, task, actor, rank, world, device, precision)
    learner = build_learner(cfg, art, device, precision, actor)
    if start_step:  # every rank restores the same checkpoint
        # a launched job's ranks may be on hosts that do not see the run directory
        restore_learner_checkpoint(learner, run_dir / "checkpoints", rank, world, device,
                                   launched() is not None, step=start_step)
    writer = MetricsWriter(run_dir / "metrics.jsonl") if rank == 0 else None
    mfu = job_utilization(cfg, art, world) if rank == 0 else None
    logs = StepLogs(cfg, task, art, run_dir, start_step, device) if rank == 0 else None
    progress = Progress(cfg.train.steps, cfg.run.progress and rank == 0, start_step=start_step,
                        columns=progress_columns(task.rule_reward, task.has_rule))
    health = StepHealth(cfg, run_dir, logs=rank == 0)  # every rank: the same verdicts
    params, seed, G = sampling_params(cfg, task), cfg.run.seed, cfg.algo.group_size
    generating = generation_precision(cfg, precision)
    check_device(generating, device)
    choose_decode(device, cfg.train.steps * cfg.generation.max_new_tokens,
                  cfg.generation.compile)
    engine = colocated_engine(cfg, art, params, device, generating)
    if engine is not None and start_step:  # resumed: the engine serves the SFT policy
        engine.update(learner)

    def generate(prompts: PromptBatch, step: int) -> RolloutBatch:
        if engine is not None:
            return engine.rollout(prompts, params, seed, step)
        with generating.compute("actor", device):
            return rollout(actor, prompts, params, seed, step, learner.version)
    for step in range(start_step, cfg.train.steps):
        prompts = task.prompt_batch(seed, "train", step, cfg.train.prompts_per_step, G)
        mine = prompts.split(G, world)[rank].to(device)  # [B/world, P], whole groups
        t0 = time.perf_counter()
        try:
            batch = generate(mine, step)
            error = batch.episode_error
            t1 = time.perf_counter()
            batch = scorer(batch)
        except (RewardServerError, EnvError):
            if world == 1:  # with more ranks the others may not fail: no collective save
                _keep_trained(cfg, learner, run_dir, step, start_step, strategy)
            raise
        t2 = time.perf_counter()
        counts: dict[str, float] = {}
        if cfg.algo.dynamic_sampling:  # groups of equal rewards out, new groups in
            batch, counts = _refilled(cfg, task, generate, scorer, batch, step, rank, world)
            counts["time_refill"] = time.perf_counter() - t2
            t2 = time.perf_counter()
        if engine is not None:
            engine.sleep()
        metrics = {**learner.train_step(batch), **counts}
        if engine is not None:  # the next rollout samples the weights just trained
            engine.update(learner)
        t3 = time.perf_counter()
        if logs is not None:  # samples.jsonl; the held-out evaluation when due
            metrics.update(logs.after_step(step, batch, learner))
        metrics.update(health.observe(step, metrics, error))
        saved = _end_step(cfg, learner, run_dir, (writer, mfu), progress, step, metrics,
                          (t0, t1, t2, t3), strategy)
        failed = health.failure is not None  # on every rank alike: metrics are global
        if failed or (stop is not None and step + 1 < cfg.train.steps and stop.agreed(world)):
            if not saved:  # every rank: gathering the learner state is collective
                _checkpoint(cfg, learner, run_dir, step + 1, strategy, rank == 0)
            progress.close()
            if writer is not None:
                writer.close()
            if logs is not None:
                logs.close()
            learner.close()
            if engine is not None:
                engine.close()
            if failed and rank == 0:  # the one that wrote the checkpoint names it
                raise health.stop()
            return False
    progress.close()
    if logs is not None:
        logs.close()
    if engine is not None:
        engine.close()
    _finish(cfg, learner, run_dir, writer, strategy)
    if stop is not None and rank == 0:
        stop.finished.set()
    return True


def _refilled(cfg: JobConfig, task: Task, generate: Callable[[PromptBatch, int], RolloutBatch],
              scorer: Scorer, first: RolloutBatch, step: int, rank: int, world: int,
              ) -> tuple[RolloutBatch, dict[str, float]]:
    """algo.dynamic_sampling (`rl/dynamic_sampling.py`): this rank's rows of the step's
    groups whose rewards vary, refilled round by round (each generated and scored as a
    step is: every rank takes part in every round)."""
    G, P = cfg.algo.group_size, cfg.train.prompts_per_step
    device = first.prompt_ids.device

    def refill(round_: int) -> RolloutBatch:
        prompts = refill_prompts(
            lambda purpose, key: task.prompt_batch(cfg.run.seed, purpose, key, P, G),
            cfg.train.steps, step, round_, cfg.algo.dynamic_sampling_max_tries, G)
        return scorer(generate(prompts.split(G, world)[rank].to(device), step))
    return dynamic_sample(first, refill, P, cfg.algo.dynamic_sampling_max_tries)


def _end_step(cfg: JobConfig, learner: Learner, run_dir: Path,
              out: tuple[MetricsWriter | None, Utilization | None], progress: Progress,
              step: int, metrics: dict, times: tuple[float, ...], strategy: str) -> bool:
    """Metrics line (utilization: every rank took part in each phase), then (when due) the
    checkpoint that includes the step; whether one was written."""
    (writer, mfu), (t0, t1, t2, t3) = out, times
    every = cfg.run.checkpoint_every
    due = bool(every) and (step + 1) % every == 0 and step + 1 < cfg.train.steps
    if writer is not None:
        world = mfu.devices if mfu is not None else 1
        busy = {"generate": (t1 - t0) * world, "score": (t2 - t1) * world,
                "train": (t3 - t2) * world}
        record = step_record(step, metrics, t3 - t0, mfu, busy, time_generate=t1 - t0,
                             time_score=t2 - t1, time_train=t3 - t2)
        writer.write(record)  # before the checkpoint that includes the step
        progress.update(record)
    if due:
        _checkpoint(cfg, learner, run_dir, step + 1, strategy, writer is not None)
    return due


def _keep_trained(cfg: JobConfig, learner: Learner, run_dir: Path, step: int,
                  start_step: int, strategy: str) -> None:
    """A reward server failed in `step`: checkpoint the steps trained since the last
    checkpoint, so that `rlhf-async resume` goes on from there once it answers again."""
    every = cfg.run.checkpoint_every
    if step > start_step and not (every and step % every == 0):
        _checkpoint(cfg, learner, run_dir, step, strategy, True)


def _checkpoint(cfg: JobConfig, learner: Learner, run_dir: Path, step: int, strategy: str,
                writes: bool) -> None:
    save_learner_checkpoint(cfg, learner, run_dir / "checkpoints", step, strategy,
                            writes=writes)


def _finish(cfg: JobConfig, learner: Learner, run_dir: Path, writer: MetricsWriter | None,
            strategy: str) -> None:
    """Rank 0 saves the final policy; every rank joins the gather and closes its engines."""
    if writer is not None:
        writer.close()
    save_final_policy(cfg, learner, run_dir / "policy", strategy, writes=writer is not None)
    learner.close()


def _worker(rank: int, world: int, port: int, cfg: JobConfig, art: Artefacts, run_dir: Path,
            start_step: int, make_scorer: ScorerFactory, strategy: str,
            precision: Precision, stop: StopRequest, env: dict[str, str] | None = None,
            cwd: str = "", console: tuple[str, bool] = ("warning", False),
            registries: Mapping[str, Any] | None = None) -> None:
    stop.rank_parent = os.getppid()
    if env is not None:  # forked from the fork server: the job's environment, not the server's
        adopt(env, cwd)
    # the lines the job's process registered at run time (a test, a notebook)
    adopt_engine_lines((registries or {}).get("engines", {}))
    adopt_adapter_lines((registries or {}).get("adapters", {}))
    configure_logging(console[0], json=console[1])  # the job's console; JSON to the file
    # the job's process handles SIGINT/SIGTERM (they reach the whole process group) and
    # tells every rank through `stop`, so all ranks stop after the same step
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    set_cpu_compute(cfg.placement.cpu_threads, cfg.placement.flush_denormal)
    hf_logging.disable_progress_bar()
    with log_to_file(run_dir / "logs" / f"rank{rank}.log", decisions=cfg.run.progress), \
            rank_group(collective_backend(cfg.placement.device), port, rank, world):
        rank_loop(cfg, art, run_dir, rank, world, start_step, make_scorer, strategy,
                  precision, stop)
    exit_rank()


@contextlib.contextmanager
def _signals_stop(stop: StopRequest) -> Iterator[threading.Event]:
    """While the ranks run: the first SIGTERM/SIGINT asks them to stop after the step (with
    a checkpoint); a second one forces the job down now (the returned event is set). A
    repeat within REPEAT_S of the first is the same request (torchrun sends two SIGTERMs
    back to back when it is stopped)."""
    forced = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield forced  # signals are delivered to the main thread only
        return
    first = 0.0  # when the stop was asked

    def handle(signum: int, _frame: object) -> None:
        nonlocal first
        name = signal.Signals(signum).name
        if stop.event.is_set():
            if time.monotonic() - first < REPEAT_S:
                return
            forced.set()
            if not _children:
                raise KeyboardInterrupt(name)  # in-process loop: unwind now
            return
        stop.set(name)
        first = time.monotonic()
        log.warning("stop_requested", signal=name,
                    hint="finishing the step and writing a checkpoint; signal again to "
                         "stop at once")
    old = {s: signal.signal(s, handle) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield forced
    finally:
        for s, h in old.items():
            signal.signal(s, h)


_children: list[object] = []  # rank processes of the running job (empty: in-process)
REPEAT_S = 1.0  # a second stop signal sooner than this is a launcher's echo of the first


def run_ranks(cfg: JobConfig, art: Artefacts, run_dir: Path, start_step: int,
              make_scorer: ScorerFactory, strategy: str, precision: Precision) -> RunResult:
    """The RL phase over `placement.devices` rank processes (in-process when 1, or when a
    launcher made this process one rank of an initialised group: job/launched.py), from
    `start_step` (restored from that step's checkpoint), each model in its `precision`.
    `make_scorer` must pickle (a module-level function or a frozen dataclass): it travels
    to every rank. A stop request ends it after the current step with a checkpoint:
    JobStopped."""
    world = cfg.placement.devices
    run_dir.mkdir(parents=True, exist_ok=True)
    stop = StopRequest()
    t0 = time.perf_counter()
    with _signals_stop(stop) as forced:
        if dist.is_initialized() or world == 1:  # this process is the rank (or the only one)
            rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() \
                else (0, 1)
            rank_loop(cfg, art, run_dir, rank, world, start_step, make_scorer, strategy,
                      precision, stop)
        else:
            # forked from the fork server (runtime.node_start = fork): no rank pays the
            # torch and transformers imports again
            fork = cfg.runtime.node_start == "fork" and can_fork()
            if fork:
                fork_server()
            ctx = mp.start_processes(_worker, args=(world, free_port(), cfg, art, run_dir,
                                                    start_step, make_scorer, strategy,
                                                    precision, stop,
                                                    dict(os.environ) if fork else None,
                                                    os.getcwd(), console_settings(),
                                                    {"engines": engine_lines(cfg),
                                                     "adapters": adapter_lines(cfg.task)}),
                                     nprocs=world, join=False,
                                     start_method="forkserver" if fork else "spawn")
            _children[:] = ctx.processes
            try:
                while not ctx.join(timeout=0.5):
                    if forced.is_set():
                        for p in ctx.processes:
                            p.kill()
                        raise KeyboardInterrupt(stop.reason)
            except mp.ProcessRaisedException as e:  # one line for the user, not a traceback
                lines = [x for x in str(e).strip().splitlines() if x.strip()]
                ours = f"{NothingTrained.__module__}.{NothingTrained.__name__}: "
                if lines and lines[-1].startswith(ours):  # every rank's: one error
                    raise NothingTrained(lines[-1].removeprefix(ours)) from None
                # "pkg.module.SomeError: message" -> "SomeError: message"
                last = re.sub(r"^[\w.]+\.(\w+: )", r"\1", lines[-1]) if lines else str(e)
                raise RankFailed(f"rank {e.error_index} failed: {last}") from None
            finally:
                _children.clear()
    if stop.event.is_set() and not stop.finished.is_set():
        raise JobStopped(stop.reason)
    return RunResult(run_dir / "metrics.jsonl", run_dir / "policy", time.perf_counter() - t0)
