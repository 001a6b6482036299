"""How the daemon runs one job: as a child `python -m rlhf_async run|resume` process.

Each job process leads its own session (pgid == pid), so the whole job, including any
node processes it forks into that session, is signalled as one group. It also gets
SIGTERM from the kernel when the daemon dies, even by SIGKILL, so a killed daemon never
leaves a job running on that a restarted daemon would start a second time.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from rlhf_async.ops.daemon.store import Job

_PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not in the forked child
PR_SET_PDEATHSIG = 1
ERROR_FILE_ENV = "RLHF_ASYNC_ERROR_FILE"  # where a job's CLI writes its one error message


def _die_with_daemon() -> None:
    # fires when the forking thread exits: the daemon forks only from its event-loop thread
    _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)


def newest_good_checkpoint(run_dir: Path) -> int | None:
    """Step of the newest checkpoint whose files match their manifest, or None."""
    # torch: the daemon loads it only when it reads a checkpoint
    from rlhf_async.rl.checkpoint import CheckpointError, list_checkpoints, verify

    for path in reversed(list_checkpoints(run_dir / "checkpoints")):
        try:
            verify(path)
        except CheckpointError:
            continue
        return int(path.name.split("-")[1])
    return None


def job_command(job: Job, configs_dir: Path, python: str = sys.executable
                ) -> tuple[list[str], int | None]:
    """The command that (re)starts `job`, and the checkpoint step it resumes from (None for
    a fresh start). A fresh start owns its run directory: leftovers of an attempt that died
    before its first checkpoint are cleared so `run` does not refuse the directory."""
    run_dir = Path(job.run_dir)
    step = newest_good_checkpoint(run_dir)
    if step is not None:
        return [python, "-m", "rlhf_async", "resume", str(run_dir)], step
    for name in ("metrics.jsonl", "trained_samples.jsonl", "summary.json"):
        (run_dir / name).unlink(missing_ok=True)
    cmd = [python, "-m", "rlhf_async", "run"]
    if job.config_text:
        configs_dir.mkdir(parents=True, exist_ok=True)
        path = configs_dir / f"job-{job.id}.toml"
        path.write_text(job.config_text)
        cmd.append(str(path))
    # last wins: the daemon owns where the run lives
    cmd += [*job.overrides, f"run.output_dir={json.dumps(str(run_dir.parent))}",
            f"run.name={json.dumps(run_dir.name)}"]
    if job.cwd:  # relative paths start where the job was submitted (a resume reads them
        cmd += ["--base-dir", job.cwd]  # resolved from the run's config.json)
    return cmd, None


def error_path(log_path: Path) -> Path:
    return log_path.with_suffix(".error")


def start_job(cmd: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    error_path(log_path).unlink(missing_ok=True)  # a previous attempt's
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           ERROR_FILE_ENV: str(error_path(log_path))}
    with open(log_path, "ab") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%dT%H:%M:%S')} {' '.join(cmd)}\n".encode())
        log.flush()
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=_die_with_daemon)


def process_alive(pid: int | None, started: float | None) -> bool:
    """The recorded job process still exists (same pid *and* same create time)."""
    if pid is None:
        return False
    try:
        proc = psutil.Process(pid)
        return (started is None or abs(proc.create_time() - started) < 1.0) and \
            proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def create_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def stop_leftover(job: Job, timeout: float) -> None:
    """End a job process a previous daemon left behind: SIGTERM its group, then SIGKILL
    after `timeout` seconds. Blocking; used once at daemon start."""
    if not process_alive(job.pid, job.pid_started) or job.pid is None:
        return
    signal_group(job.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while process_alive(job.pid, job.pid_started) and time.monotonic() < deadline:
        time.sleep(0.1)
    if process_alive(job.pid, job.pid_started):
        signal_group(job.pid, signal.SIGKILL)
        while process_alive(job.pid, job.pid_started):
            time.sleep(0.05)


def job_error(log_path: Path, rc: int) -> str:
    """Why a job failed, for the job list: the error message its CLI wrote; else the
    exception ending a traceback in its output; else how the process ended."""
    try:
        message = error_path(log_path).read_text().strip()
    except OSError:
        message = ""
    if message:
        return message
    exception = _last_exception(log_path)
    if exception:
        return exception
    if rc < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-rc).name}"
    return f"exited with code {rc}"


def _last_exception(path: Path, max_bytes: int = 65536) -> str:
    """'ValueError: ...', the line that ends the output's last traceback, or ''."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - max_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    starts = [i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call")]
    if not starts:
        return ""
    return next((ln.strip() for ln in lines[starts[-1] + 1:] if ln.strip() and
                 not ln[0].isspace()), "")
