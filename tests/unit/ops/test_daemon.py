"""Daemon pieces without running a job: the SQLite store, the job command, the control
protocol's answers to bad requests, and the /metrics collector."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from rlhf_async.config import load_config
from rlhf_async.ops.daemon import Daemon, JobStore
from rlhf_async.ops.daemon.jobs import error_path, job_command, job_error, process_alive
from rlhf_async.ops.daemon.metrics import JobCollector, last_record


def _daemon(tmp_path: Path) -> Daemon:
    d = Daemon(tmp_path / "state")
    d.prepare()
    return d


def test_store_keeps_jobs_across_connections(tmp_path):
    store = JobStore(tmp_path / "jobs.db")
    job = store.add("/x/a.toml", "[train]\nsteps = 2\n", ["algo.name=grpo"], tmp_path / "runs",
                    tmp_path / "logs")
    store.update(job.id, state="running", pid=123, attempts=1)
    store.close()
    again = JobStore(tmp_path / "jobs.db")
    got = again.get(job.id)
    assert (got.state, got.pid, got.attempts, got.overrides) == ("running", 123, 1,
                                                                  ["algo.name=grpo"])
    assert got.run_dir == str(tmp_path / "runs" / "job-1")
    assert again.counts()["running"] == 1 and again.counts()["queued"] == 0
    assert again.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    with pytest.raises(ValueError, match="unknown job fields"):
        again.update(job.id, colour="red")


def test_job_command_fresh_then_resume(tmp_path):
    store = JobStore(tmp_path / "jobs.db")
    job = store.add("/x/a.toml", "[train]\nsteps = 2\n", ["train.lr=1e-4"], tmp_path / "runs",
                    tmp_path / "logs")
    run_dir = Path(job.run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')  # died before its first checkpoint
    cmd, step = job_command(job, tmp_path / "configs", python="py")
    assert step is None and cmd[:4] == ["py", "-m", "rlhf_async", "run"]
    assert Path(cmd[4]).read_text() == "[train]\nsteps = 2\n"
    assert cmd[5] == "train.lr=1e-4" and cmd[-1] == 'run.name="job-1"'
    assert not (run_dir / "metrics.jsonl").exists()
    from rlhf_async.rl.checkpoint import save_checkpoint

    save_checkpoint(run_dir / "checkpoints", 3, {"w": __import__("torch").zeros(2)}, {})
    cmd, step = job_command(job, tmp_path / "configs", python="py")
    assert step == 3 and cmd == ["py", "-m", "rlhf_async", "resume", str(run_dir)]


def test_control_requests(tmp_path):
    d = _daemon(tmp_path)
    assert os.stat(d.paths.root).st_mode & 0o777 == 0o700
    job = d.handle({"op": "submit", "config_text": "", "config_name": "",
                    "overrides": ["train.steps=2"]})
    assert job["state"] == "queued" and job["id"] == 1
    for request, error in (({"op": "launch"}, "unknown op 'launch'"),
                           ({"op": "job", "id": "1"}, "job id must be an integer"),
                           ({"op": "job", "id": 9}, "no job 9"),
                           ({"op": "submit", "overrides": ["train.steps=-1"]}, "train.steps"),
                           ({"op": "submit", "overrides": "x"}, "list of key=value")):
        with pytest.raises(ValueError, match=error):
            d.handle(request)
    assert d.handle({"op": "cancel", "id": 1})["state"] == "cancelled"
    with pytest.raises(ValueError, match="already cancelled"):
        d.handle({"op": "cancel", "id": 1})
    assert [j["state"] for j in d.handle({"op": "jobs"})] == ["cancelled"]


def test_restart_settles_jobs_left_running(tmp_path):
    d = _daemon(tmp_path)
    assert d.store is not None
    for i in range(3):
        d.handle({"op": "submit", "overrides": []})
        d.store.update(i + 1, state="running", pid=999999999, pid_started=1.0)
    Path(d.store.get(1).run_dir).mkdir(parents=True)
    (Path(d.store.get(1).run_dir) / "summary.json").write_text("{}")  # finished, unrecorded
    d.store.update(3, cancel_requested=1)
    d.store.close()
    again = _daemon(tmp_path)
    assert again.store is not None
    asyncio.run(again.settle_leftovers())  # what serve() starts as it opens its socket
    assert [j.state for j in again.store.list()] == ["finished", "queued", "cancelled"]


def test_process_alive_checks_create_time():
    import psutil

    me = psutil.Process()
    assert process_alive(me.pid, me.create_time())
    assert not process_alive(me.pid, me.create_time() - 100)  # a reused pid
    assert not process_alive(None, None)


def test_metrics_collector_reads_running_jobs(tmp_path):
    d = _daemon(tmp_path)
    assert d.store is not None
    d.handle({"op": "submit", "overrides": []})
    d.store.update(1, state="running")
    run_dir = Path(d.store.get(1).run_dir)
    run_dir.mkdir(parents=True)
    rec = {"step": 7, "samples_per_s": 12.5, "weight_sync_s": 0.25, "queue/generated": 3,
           "staleness/mean": 0.5, "staleness_hist": {"0": 4}}
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 6}) + "\n" + json.dumps(rec)
                                           + "\n{\"step\": 8, \"trunc")
    assert last_record(run_dir / "metrics.jsonl") == rec
    registry = CollectorRegistry()
    registry.register(JobCollector(d.paths.db))
    text = generate_latest(registry).decode()
    for line in ('rlhf_daemon_jobs{state="running"} 1.0', 'rlhf_job_step{job="1"} 7.0',
                 'rlhf_job_samples_per_second{job="1"} 12.5',
                 'rlhf_job_weight_sync_seconds{job="1"} 0.25',
                 'rlhf_job_queue_depth{job="1",queue="generated"} 3.0',
                 'rlhf_job_staleness{job="1",stat="mean"} 0.5'):
        assert line in text, text


def test_job_error_is_the_jobs_message_not_its_last_log_lines(tmp_path):
    log = tmp_path / "job-1.log"
    log.write_text('=== 12:00 python -m rlhf_async run\n{"event": "sft step"}\n'
                   "Traceback (most recent call last):\n  File \"x.py\", line 1, in f\n"
                   "    boom()\nRuntimeError: CUDA out of memory\n{\"event\": \"bye\"}\n")
    assert job_error(log, 1) == "RuntimeError: CUDA out of memory"
    error_path(log).write_text("invalid configuration (1 problem(s)):\n  - a.b: bad\n")
    assert job_error(log, 2) == "invalid configuration (1 problem(s)):\n  - a.b: bad"
    log.write_text('{"event": "step", "step": 3}\n')
    error_path(log).unlink()
    assert job_error(log, -9) == "killed by SIGKILL"
    assert job_error(tmp_path / "missing.log", 3) == "exited with code 3"


def test_cli_without_daemon_is_one_line(tmp_path, capsys):
    from rlhf_async.cli import main

    assert main(["jobs", "--state-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no daemon running" in err


def test_stop_requeues_running_jobs_and_cancel_ends_one(tmp_path, monkeypatch):
    """A stop (SIGTERM's path) ends every job's process group and requeues the job; a
    cancel ends that job only. Jobs here are sleeping stand-ins for `rlhf-async run`."""
    import asyncio
    import signal

    from rlhf_async.ops.daemon import jobs as jobproc

    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    monkeypatch.setattr(jobproc, "job_command", lambda job, configs: (sleeper, None))
    d = Daemon(tmp_path / "state", max_jobs=2, stop_timeout=10, poll_s=0.05)
    store = d.prepare()
    for _ in range(2):
        d.handle({"op": "submit", "overrides": []})
    store.close()

    async def scenario() -> list[str]:
        serving = asyncio.create_task(d.serve())
        while len(d.children) < 2:
            await asyncio.sleep(0.05)
        pids = [p.pid for p in d.children.values()]
        assert d.handle({"op": "cancel", "id": 2})["cancel_requested"]
        while 2 in d.children:
            await asyncio.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)  # the daemon's own stop path
        assert await asyncio.wait_for(serving, 30) == 0
        assert not any(process_alive(pid, None) for pid in pids)
        again = JobStore(d.paths.db)
        try:
            return [j.state for j in again.list()]
        finally:
            again.close()

    assert asyncio.run(scenario()) == ["queued", "cancelled"]
    assert not d.paths.socket.exists()


def test_sighup_reopens_the_log_file(tmp_path):
    import signal
    import subprocess
    import time

    from rlhf_async.ops.daemon import DaemonError, call_daemon

    log = tmp_path / "daemon.log"
    proc = subprocess.Popen([sys.executable, "-m", "rlhf_async", "serve", "--state-dir",
                             str(tmp_path / "state"), "--log-file", str(log)])
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                call_daemon(tmp_path / "state", {"op": "ping"}, timeout=5)
                break
            except DaemonError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.2)
        log.rename(tmp_path / "daemon.log.1")  # what logrotate does
        proc.send_signal(signal.SIGHUP)
        while not (log.exists() and "log reopened" in log.read_text()):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert "daemon serving" in (tmp_path / "daemon.log.1").read_text()
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    assert "daemon stopped" in log.read_text()


def test_submit_resolves_relative_paths_where_it_was_submitted(tmp_path, monkeypatch):
    user = tmp_path / "user"
    (user / "m").mkdir(parents=True)
    (user / "m" / "config.json").write_text('{"n_positions": 512}')
    (user / "p.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    (user / "r.py").write_text("def f(p, r):\n    return 0.0\n")
    monkeypatch.chdir(tmp_path)  # the daemon's own working directory: none of them here
    d = _daemon(tmp_path)
    config = '[model]\npath = "m"\n[task]\nname = "text"\n'
    request = {"op": "submit", "config_text": config, "config_name": str(user / "c.toml"),
               "overrides": ["task.prompts=p.jsonl", "task.reward=r.py:f"]}
    with pytest.raises(ValueError, match="model.path: 'm' is not a directory"):
        d.handle(request)  # an older client: no cwd, the daemon's directory
    job = d.handle({**request, "cwd": str(user)})
    assert job["cwd"] == str(user)
    cmd, _ = job_command(d.store.get(job["id"]), d.paths.configs, python="py")
    assert cmd[-2:] == ["--base-dir", str(user)]
    cfg = load_config(cmd[4], cmd[5:-2], base_dir=cmd[-1])  # what that command loads
    assert (cfg.model.path, cfg.task.prompts, cfg.task.reward) == (
        str(user / "m"), str(user / "p.jsonl"), f"{user / 'r.py'}:f")
    assert load_config(None, ["task.reward=mod.rewards:f"], base_dir=user).task.reward == \
        "mod.rewards:f"  # a module, not a file: imported as it is
    with pytest.raises(ValueError, match="cwd must be an absolute directory"):
        d.handle({**request, "cwd": "user"})


def test_cli_run_base_dir_and_a_bad_toml_named_by_the_users_file(tmp_path, capsys):
    from rlhf_async.cli import main

    assert main(["run", "model.path=nope", "--base-dir", str(tmp_path)]) == 2
    assert f"model.path: '{tmp_path / 'nope'}' is not a directory" in capsys.readouterr().err
    d = _daemon(tmp_path)
    with pytest.raises(ValueError, match="config file '/home/u/job.toml': not valid TOML"):
        d.handle({"op": "submit", "config_text": "[train\n", "config_name": "/home/u/job.toml",
                  "overrides": [], "cwd": "/home/u"})


def test_a_restarted_daemon_answers_while_the_job_it_found_running_stops(tmp_path,
                                                                         monkeypatch):
    """A job a previous daemon left running checkpoints on SIGTERM, which may take up to
    `stop_timeout`: the new daemon answers meanwhile (it used to open its socket only after),
    starts nothing beside the job, then requeues it and starts it again."""
    import asyncio
    import subprocess

    from rlhf_async.ops.daemon import call_daemon
    from rlhf_async.ops.daemon import jobs as jobproc

    released = tmp_path / "released"
    # the leftover: its "checkpoint" lasts until the test has had its answer
    leftover = subprocess.Popen(
        [sys.executable, "-c", "import os, signal, sys, time\n"
         "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True)\n"
         f"while not os.path.exists({str(released)!r}): time.sleep(0.05)"],
        stdout=subprocess.PIPE, start_new_session=True)
    assert leftover.stdout is not None and leftover.stdout.readline() == b"\n"
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    monkeypatch.setattr(jobproc, "job_command", lambda job, configs: (sleeper, None))
    d = Daemon(tmp_path / "state", stop_timeout=600, poll_s=0.05)
    store = d.prepare()
    d.handle({"op": "submit", "overrides": []})
    store.update(1, state="running", pid=leftover.pid,
                 pid_started=jobproc.create_time(leftover.pid))
    store.close()

    async def scenario() -> tuple[dict, dict]:
        serving = asyncio.create_task(d.serve())
        while not d.paths.socket.exists():
            await asyncio.sleep(0.05)
        meanwhile = await asyncio.to_thread(call_daemon, d.paths.root, {"op": "job", "id": 1})
        assert leftover.poll() is None and not d.children  # still stopping; nothing beside it
        released.touch()
        while 1 not in d.children:
            await asyncio.sleep(0.05)
        again = await asyncio.to_thread(call_daemon, d.paths.root, {"op": "job", "id": 1})
        d._request_stop("test")
        assert await asyncio.wait_for(serving, 60) == 0
        return meanwhile, again

    try:
        meanwhile, again = asyncio.run(scenario())
        assert leftover.wait(60) == 0
    finally:  # a failed or timed-out test leaves no process behind
        released.touch()
        leftover.kill()
    assert (meanwhile["state"], meanwhile["pid"]) == ("running", leftover.pid)
    assert again["state"] == "running" and again["pid"] != leftover.pid, again


def test_a_failed_jobs_error_reaches_the_job_list_whole(tmp_path, monkeypatch, capsys):
    """A job the CLI rejects: its error (ending in a quote) is what the daemon answers and
    what `jobs` lists, not log lines."""
    import asyncio

    from rlhf_async.cli import main
    from rlhf_async.ops.daemon import DaemonError, call_daemon
    from rlhf_async.ops.daemon import jobs as jobproc

    failing = [sys.executable, "-m", "rlhf_async", "run", "algo.name=dpo"]
    monkeypatch.setattr(jobproc, "job_command", lambda job, configs: (failing, None))
    d = Daemon(tmp_path / "state", poll_s=0.05)
    store = d.prepare()
    d.handle({"op": "submit", "overrides": []})
    store.close()
    want = "algo.name: 'dpo' is not one of 'ppo', 'grpo', 'rloo', 'dapo', 'gspo', 'dr_grpo', 'reinforce_pp', 'cispo', 'distill'"

    async def scenario() -> str:
        serving = asyncio.create_task(d.serve())
        while d.store is store or d.store.get(1).state != "failed":  # serving: a new one
            await asyncio.sleep(0.05)
        with pytest.raises(DaemonError) as e:
            await asyncio.to_thread(call_daemon, d.paths.root,
                                    {"op": "submit", "overrides": ["algo.name=dpo"]})
        assert str(e.value).endswith(want)
        assert await asyncio.to_thread(main, ["jobs", "--state-dir", str(d.paths.root)]) == 0
        error = d.store.get(1).error
        d._request_stop("test")
        assert await asyncio.wait_for(serving, 30) == 0
        return error

    assert asyncio.run(scenario()) == f"invalid configuration (1 problem(s)):\n  - {want}"
    out = capsys.readouterr().out
    assert f"      error: invalid configuration (1 problem(s)):\n               - {want}\n" in out


def test_a_store_from_before_cwd_gains_the_column(tmp_path):
    import sqlite3

    from rlhf_async.ops.daemon.store import _SCHEMA

    old = sqlite3.connect(tmp_path / "jobs.db")
    old.execute(_SCHEMA[:_SCHEMA.index(",\n    cwd")] + "\n)")  # the table without it
    old.close()
    store = JobStore(tmp_path / "jobs.db")
    job = store.add("", "", [], tmp_path / "runs", tmp_path / "logs", "/home/u")
    assert store.get(job.id).cwd == "/home/u"


def test_scale_requests_refused_before_any_job_is_asked(tmp_path):
    import asyncio

    d = _daemon(tmp_path)
    d.handle({"op": "submit", "overrides": []})
    running = d.handle({"op": "submit", "overrides": []})
    assert d.store is not None
    d.store.update(running["id"], state="running")
    for request, error in (
            ({"id": 1, "generators": 2}, "job 1 is queued: only a running job scales"),
            ({"id": 2, "workers": 2}, "unknown: workers"),
            ({"id": 2, "generators": "2"}, "whole-number generators and scorers"),
            ({"id": 2, "generators": 0}, "generators=0: a count must be at least 1"),
            ({"id": 2, "generators": 2, "timeout": -1}, "timeout must be a positive"),
            ({"id": 2, "scorers": 2}, "job 2: .* holds no job")):
        with pytest.raises(ValueError, match=error):
            asyncio.run(d._scale({"op": "scale", **request}))
