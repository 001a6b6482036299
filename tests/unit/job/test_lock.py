"""One job per run directory (`job/lock.py`): a second run or resume on a live directory
is refused naming the holder, a dead holder's lock is taken over, and the lock goes when
the job ends, also on error."""

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys

import pytest
from structlog.testing import capture_logs

from rlhf_async.cli import main
from rlhf_async.config import ConfigError, load_config, to_dict
from rlhf_async.job import run
from rlhf_async.job.lock import LOCK_FILE, RunLockError, hold_run_dir
from rlhf_async.strategies import registry
from tests.unit.strategies import toy_strategy

HOLD = ("import sys, time; from pathlib import Path; from rlhf_async.job.lock import "
        "hold_run_dir\nwith hold_run_dir(Path(sys.argv[1])):\n    print('held', flush=True)\n"
        "    time.sleep(120)\n")


@pytest.fixture
def holder(tmp_path):
    """Another process holding tmp_path/runs/r."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "runs" / "r")],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    yield proc
    proc.kill()
    proc.wait()


def test_a_second_run_or_resume_on_a_live_directory_is_refused(tmp_path, holder, capsys):
    run_dir = tmp_path / "runs" / "r"
    args = [f"run.output_dir={json.dumps(str(tmp_path / 'runs'))}", "run.name=r",
            "run.progress=false"]
    assert main(["run", *args]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"pid {holder.pid} on host {socket.gethostname()}" in err[0]
    assert err[0].startswith(f"rlhf-async run: error: {run_dir} is in use by another run")
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE]  # nothing written
    config = to_dict(load_config(None, args))
    (run_dir / "config.json").write_text(json.dumps(config))
    assert main(["resume", str(run_dir)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"pid {holder.pid} on host" in err[0]
    assert json.loads((run_dir / "config.json").read_text()) == config
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.json", LOCK_FILE]


def test_a_dead_holders_lock_is_taken_over_with_a_warning(tmp_path, holder):
    run_dir = tmp_path / "runs" / "r"
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == holder.pid  # left behind
    with capture_logs() as logs, hold_run_dir(run_dir):
        mine = json.loads((run_dir / LOCK_FILE).read_text())
        assert mine["pid"] == os.getpid() and mine["host"] == socket.gethostname()
    (warning,) = [e for e in logs if e["log_level"] == "warning"]
    assert warning["event"] == "taking over the lock of a run that is gone"
    assert warning["pid"] == holder.pid
    assert not (run_dir / LOCK_FILE).exists()


def test_a_lock_naming_another_host_is_refused(tmp_path):
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": 1, "host": "gpu-b"}))
    where = f"checked from {socket.gethostname()}; if that run has ended, delete"
    with pytest.raises(RunLockError, match=f"names pid 1 on host gpu-b, which cannot be {where}"):
        hold_run_dir(tmp_path).__enter__()
    assert (tmp_path / LOCK_FILE).exists()  # not ours to remove


def test_the_lock_is_held_for_the_whole_job_and_released_also_on_error(tmp_path,
                                                                       monkeypatch):
    seen = []

    def solo_run(cfg, placement, art, run_dir, start_step=0):
        seen.append(json.loads((run_dir / LOCK_FILE).read_text())["pid"])
        with pytest.raises(RunLockError, match=f"pid {os.getpid()} on host"):
            hold_run_dir(run_dir).__enter__()  # even this same process cannot take it twice
        if len(seen) == 1:
            raise RuntimeError("the strategy failed")
        return toy_strategy.run(cfg, placement, art, run_dir, start_step)

    monkeypatch.setitem(registry.STRATEGIES, "solo",
                        dataclasses.replace(toy_strategy.STRATEGY, run=solo_run))
    cfg = load_config(None, [f"run.cache_dir={json.dumps(str(tmp_path / 'cache'))}",
                             "placement.strategy=solo", "run.name=r", "sft.steps=2",
                             f"run.output_dir={json.dumps(str(tmp_path))}", "train.steps=1",
                             "reward_model.steps=2", "run.eval_prompts=4", "run.plot=false",
                             "run.progress=false"])
    with pytest.raises(RuntimeError, match="the strategy failed"):
        run(cfg)
    assert not (tmp_path / "r" / LOCK_FILE).exists()
    assert run(cfg)["strategy"] == "solo" and seen == [os.getpid()] * 2
    assert not (tmp_path / "r" / LOCK_FILE).exists()
    with pytest.raises(ConfigError, match="already holds a run"):
        run(cfg)
    assert not (tmp_path / "r" / LOCK_FILE).exists()
