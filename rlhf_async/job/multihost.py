"""A job across hosts: SFT/RM artefacts here, then the RL phase as Separation with its nodes
on the hosts of a hosts file (each host runs `rlhf-async agent`); resumes from the newest
checkpoint of `run.name` when there is one."""

from __future__ import annotations

import json
import time
from pathlib import Path

from rlhf_async.config import JobConfig, to_dict
from rlhf_async.job.lock import hold_run_dir
from rlhf_async.metrics import truncate_metrics
from rlhf_async.planning.planner import prepare_run
from rlhf_async.rl.checkpoint import load_latest
from rlhf_async.runtime import run_loop
from rlhf_async.runtime.hosts import Host
from rlhf_async.strategies.placement import Placement
from rlhf_async.strategies.separation.multihost import run_hosts
from rlhf_async.strategies.separation.startup import PipelineError
from rlhf_async.task import make_task
from rlhf_async.task.pretrain import prepare_artefacts


def run_multihost(cfg: JobConfig, hosts: list[Host], keys: Path, address: str) -> dict:
    """SFT/RM artefacts here, then the RL phase as Separation across the hosts."""
    cfg, placement = prepare_run(cfg)
    if cfg.placement.strategy != "separation":
        raise PipelineError(f"multi-host runs use placement.strategy=separation, not "
                            f"{cfg.placement.strategy!r}")
    if not cfg.run.name:
        raise PipelineError("multi-host runs need run.name (the agents' run directory name)")
    run_dir = (Path(cfg.run.output_dir) / cfg.run.name).resolve()
    with hold_run_dir(run_dir):  # one job per run directory, before anything is written
        return _run_held(cfg, placement, hosts, keys, address, run_dir)


def _run_held(cfg: JobConfig, placement: Placement, hosts: list[Host], keys: Path,
              address: str, run_dir: Path) -> dict:
    ck = load_latest(run_dir / "checkpoints")
    start_step = 0 if ck is None else ck.step
    truncate_metrics(run_dir, start_step)  # steps after the checkpoint are trained again
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    art = prepare_artefacts(cfg, make_task(cfg))
    (run_dir / "placement.txt").write_text(placement.table() + "\n")
    t0 = time.perf_counter()
    result = run_loop(run_hosts(cfg, art, run_dir, placement, hosts, keys, address, start_step))
    summary = {"run_dir": str(run_dir), "start_step": start_step,
               "rl_seconds": time.perf_counter() - t0, "policy_dir": result["policy_dir"]}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
