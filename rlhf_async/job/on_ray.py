"""A lock-step job (Flattening, Interleaving) on a Ray cluster (`placement.launcher = ray`):
Ray in torchrun's place. One placement group, one bundle per device; on bundle r a NodeHost
actor (`RayLauncher`) starts `rlhf-async run CONFIG.json` as rank r with RANK, WORLD_SIZE,
MASTER_ADDR (rank 0's Ray node), MASTER_PORT (free there) and LOCAL_RANK=0 (its bundle's
GPU is its only one) set: from there it is the launched job of job/launched.py, rank 0
holding the run directory and doing SFT/RM, evaluation and the summary.

This process only launches and waits. The config travels as a file (the resolved config,
run.name fixed) in `run.output_dir`, which, like `run.cache_dir`, must be on a filesystem
every Ray node sees; each rank's output is RUN_DIR/logs/rankR.log, where it ran a line of
RUN_DIR/ray_nodes.jsonl. A rank that exits non-zero or is lost with its Ray node fails the
job, as a rank does on one machine: the others are stopped and one RankFailed names it;
`rlhf-async resume RUN_DIR` continues from the newest checkpoint. A stop signal goes to
every rank (they finish the step and write a checkpoint together); a second kills them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from rlhf_async.config import JobConfig, to_dict
from rlhf_async.job.lock import check_free
from rlhf_async.job.signals import on_stop_signals
from rlhf_async.log import get_logger
from rlhf_async.runtime.launcher import last_log_line
from rlhf_async.runtime.ray_cluster import DeviceGroup, ray_cluster, reserve
from rlhf_async.runtime.ray_launcher import LOST, RayLauncher, RayProcess
from rlhf_async.runtime.spec import NodeSpec
from rlhf_async.strategies.base import RankFailed

log = get_logger(component="ray")
STOP_WAIT_S = 10.0  # after one rank failed, how long the others get to exit on their own


def run_ranks(cfg: JobConfig, run_dir: Path, resume: bool) -> str | None:
    """The RL job's ranks on the Ray cluster until they all exit; the stop this process
    passed on to them (a signal's name), or None. RankFailed when one fails."""
    check_free(run_dir)  # a directory another job holds is refused before anything starts
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(
        cfg.run, name=run_dir.name, output_dir=str(run_dir.parent.resolve())))
    with ray_cluster(cfg) as bundles, \
            reserve(bundles, cfg.ray.placement_strategy, cfg.ray.placement_timeout_s,
                    name=f"rlhf-async:{run_dir.name}") as group, \
            _config_file(cfg) as config:
        command = ["-m", "rlhf_async", "resume", str(run_dir)] if resume else \
            ["-m", "rlhf_async", "run", str(config), "--base-dir", os.getcwd()]
        return _wait(_launch(cfg, group, run_dir.resolve(), command), run_dir)


@contextlib.contextmanager
def _config_file(cfg: JobConfig) -> Iterator[Path]:
    """The resolved config as JSON beside the run directories (every Ray node sees them)."""
    out = Path(cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{cfg.run.name}.", suffix=".config.json", dir=out)
    with os.fdopen(fd, "w") as f:
        json.dump(to_dict(cfg), f)
    try:
        yield Path(name)
    finally:
        Path(name).unlink(missing_ok=True)


def _launch(cfg: JobConfig, group: DeviceGroup, run_dir: Path,
            command: list[str]) -> list[RayProcess]:
    world, kind = cfg.placement.devices, cfg.placement.device
    master = group.address(0)
    env = {"WORLD_SIZE": str(world), "MASTER_ADDR": master, "LOCAL_RANK": "0",
           "MASTER_PORT": str(group.port_source({master: 1})(master))}
    specs = [NodeSpec("rank", f"rank{r}", "rlhf_async.cli.main:entry", device=f"{kind}:{r}",
                      env={**env, "RANK": str(r)}, num_threads=cfg.placement.cpu_threads,
                      flush_denormal=cfg.placement.flush_denormal)
             for r in range(world)]
    launcher = RayLauncher(group, specs)
    log.info("ray ranks starting", world=world, master=f"{master}:{env['MASTER_PORT']}",
             run_dir=str(run_dir))
    return [launcher.launch(s, run_dir, command) for s in specs]


def _wait(ranks: list[RayProcess], run_dir: Path) -> str | None:
    """Until every rank exited: 0 from all, or RankFailed for the first that did not."""
    with _passing_stops(ranks) as stop:
        try:
            while True:
                codes = [r.poll() for r in ranks]
                failed = [(i, rc) for i, rc in enumerate(codes) if rc not in (None, 0)]
                if failed:
                    raise RankFailed(_failure(ranks, run_dir, *failed[0]))
                if all(rc == 0 for rc in codes):
                    return stop[0] if stop else None
                time.sleep(0.2)
        except KeyboardInterrupt:  # a second stop signal: now
            _stop_all(ranks, 0.0)
            raise
        finally:
            _stop_all(ranks, STOP_WAIT_S)


def _failure(ranks: list[RayProcess], run_dir: Path, rank: int, rc: int) -> str:
    """Why rank N failed: lost, killed, or its exit code and last log line (the log is on
    the shared filesystem)."""
    last = last_log_line(run_dir / "logs" / f"rank{rank}.log")
    if rc == LOST:
        why = "its actor or Ray node was lost"
    elif rc < 0:  # a killed process leaves no last word of its own
        why = f"killed by {signal.Signals(-rc).name}"
    else:
        why = f"exit {rc}: {last or 'no output'}"
    return f"rank {rank} failed on Ray ({why}); log: {ranks[rank].log_path}"


def _stop_all(ranks: list[RayProcess], grace_s: float) -> None:
    """The ranks still running: asked to stop, then killed after `grace_s`."""
    live = [r for r in ranks if r.poll() is None]
    for r in live if grace_s else ():
        r.terminate()
    deadline = time.monotonic() + grace_s
    while live and time.monotonic() < deadline:
        time.sleep(0.2)
        live = [r for r in live if r.poll() is None]
    for r in ranks:
        r.kill()  # ends each actor, freeing its bundle share


@contextlib.contextmanager
def _passing_stops(ranks: list[RayProcess]) -> Iterator[list[str]]:
    """While the ranks run: SIGTERM/SIGINT here is SIGTERM to every rank (the launched ranks
    agree on the stop); a second one, a moment later, interrupts (and so kills them)."""
    stopped: list[str] = []
    first = 0.0

    def handle(signum: int, _frame: object) -> None:
        nonlocal first
        name = signal.Signals(signum).name
        if stopped:
            if time.monotonic() - first > 1.0:  # not a launcher's echo of the first
                raise KeyboardInterrupt(name)
            return
        stopped.append(name)
        first = time.monotonic()
        log.warning("stop_requested", signal=name, hint="passed on to every rank; they "
                    "finish the step and write a checkpoint; signal again to stop at once")
        for r in ranks:
            r.terminate()
    with on_stop_signals(handle):
        yield stopped
