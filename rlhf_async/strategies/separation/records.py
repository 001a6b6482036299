"""What the Driver writes for each step the trainer reports: one metrics.jsonl record (the
trainer's metrics and what only the coordinator sees: each node's utilisation since the
last record, the chunk queues, the faults so far), the step's verdict (`StepHealth`), the
progress line, and the hooks that read the record (online rebalancing). A trainer that
restarted from a checkpoint takes the records of the steps it lost with it (`rollback`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlhf_async.config import JobConfig
from rlhf_async.metrics import MetricsWriter, Progress, progress_columns, truncate_metrics
from rlhf_async.modeling.flops import Utilization
from rlhf_async.pipeline.protocol import Trained
from rlhf_async.pipeline.training import step_record
from rlhf_async.rl.checkpoint import disk_full
from rlhf_async.strategies.step_health import StepHealth
from rlhf_async.strategies.utilization import stage_busy
from rlhf_async.task import Task


class StepRecords:
    def __init__(self, cfg: JobConfig, run_dir: Path, task: Task, start_step: int,
                 roles: dict[str, str], utilization: Utilization | None = None) -> None:
        self.cfg, self.run_dir, self.roles = cfg, run_dir, roles
        self.utilization = utilization  # mfu/* in the step records (one device a process)
        self.progress = Progress(cfg.train.steps, cfg.run.progress, start_step=start_step,
                                 columns=progress_columns(task.rule_reward, task.has_rule))
        self.health = StepHealth(cfg, run_dir)
        self.on_record: list[Callable[[dict[str, Any]], None]] = []  # may add to a record
        self.episode_errors: dict[int, str] = {}  # step -> its first failed episode's error
        self.busy: dict[str, float] = {}  # node -> cumulative busy seconds
        self.last_busy: dict[str, float] = {}  # ... at the last record
        self.t_last = time.perf_counter()
        self.open()

    def open(self) -> None:
        self.writer = MetricsWriter(self.run_dir / "metrics.jsonl")

    def close(self) -> None:
        self.writer.close()
        self.progress.close()

    def episode_error(self, step: int, error: str) -> None:
        self.episode_errors.setdefault(step, error)

    def write(self, trainer: str, t: Trained, **state: Any) -> None:
        """The record of step `t.step`, with the pipeline's `state` beside the trainer's
        own; raises the run's failure when this step makes one (`StepHealth`)."""
        now = time.perf_counter()
        dt, self.t_last = now - self.t_last, now
        self.busy[trainer] = t.busy_s
        util = {f"util/{n}": (b - self.last_busy.get(n, 0.0)) / dt for n, b in self.busy.items()}
        self.last_busy = dict(self.busy)
        record = step_record(
            t.step, t.metrics, dt, self.utilization, stage_busy(util, self.roles, dt),
            rollout_version=t.rollout_version,
            weight_sync_s=t.weight_sync.seconds, weight_sync_bytes=t.weight_sync.bytes,
            staleness_hist=t.staleness_hist, **t.staleness, **state,
            **{"queue/trainer": t.queue_trainer}, **util)
        # the step's error may come after its record (another socket): any step's will do
        error = self.episode_errors.pop(t.step, "") or next(
            (e for _, e in sorted(self.episode_errors.items())), "")
        failing = self.health.failure
        record.update(self.health.observe(t.step, record, error))
        for hook in self.on_record:  # online rebalancing (rebalance.py)
            hook(record)
        try:
            self.writer.write(record)
        except OSError as e:  # a full disk: one error naming it, not a traceback
            full = disk_full(e, self.run_dir / "metrics.jsonl")
            if full is None:
                raise
            raise full from None
        self.progress.update(record)
        if failing is None and self.health.failure is not None:  # drive() checkpoints
            raise self.health.failure

    def rollback(self, step: int) -> None:
        """The trainer restarted from the checkpoint of `step`: the records of later steps
        are dropped (they will be trained, and written, again)."""
        self.progress.phase.done = step
        self.writer.close()
        truncate_metrics(self.run_dir, step, trainer_running=True)
        self.open()
        self.health = StepHealth(self.cfg, self.run_dir)  # the lost steps come again

    def forget(self, node: str) -> None:
        """A retired node: no utilisation of it in later records."""
        self.busy.pop(node, None)
        self.last_busy.pop(node, None)

