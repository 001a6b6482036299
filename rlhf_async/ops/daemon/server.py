"""`rlhf-async serve`: a long-lived service that runs submitted jobs one after another.

    STATE_DIR/jobs.db        job table (SQLite, WAL)
    STATE_DIR/control.sock   control socket (unix, 0600; the state dir itself is 0700)
    STATE_DIR/runs/job-N     run directories;   STATE_DIR/logs/job-N.log   job output
    STATE_DIR/configs/       submitted configs, frozen at submit time

Control protocol: one JSON object per line each way, e.g. `{"op": "submit", ...}` ->
`{"ok": true, "result": ...}` or `{"ok": false, "error": "..."}`.

Signals: SIGTERM/SIGINT stop every job's process group (the job writes what it can; the
next start resumes from its newest good checkpoint), mark those jobs queued and exit 0.
SIGHUP reopens the log file (after logrotate moved it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import rlhf_async.ops.daemon.jobs as jobproc
from rlhf_async.config import ConfigError, load_config
from rlhf_async.log import get_logger
from rlhf_async.ops.daemon.store import DONE_STATES, Job, JobStore

log = get_logger(component="daemon")
MAX_REQUEST_BYTES = 4 << 20


class DaemonError(RuntimeError):
    """The daemon cannot start or cannot be reached; one line for the CLI."""


@dataclass(frozen=True)
class StatePaths:
    root: Path

    @property
    def db(self) -> Path:
        return self.root / "jobs.db"

    @property
    def socket(self) -> Path:
        return self.root / "control.sock"

    @property
    def runs(self) -> Path:
        return self.root / "runs"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def configs(self) -> Path:
        return self.root / "configs"


class Daemon:
    def __init__(self, state_dir: str | Path, *, max_jobs: int = 1, stop_timeout: float = 60.0,
                 log_file: Path | None = None, poll_s: float = 0.2) -> None:
        self.paths = StatePaths(Path(state_dir).resolve())
        self.max_jobs, self.stop_timeout, self.poll_s = max_jobs, stop_timeout, poll_s
        self.log_file = log_file
        self.children: dict[int, subprocess.Popen[bytes]] = {}
        self.stopping = asyncio.Event()
        self.store: JobStore | None = None

    # ---- lifecycle -------------------------------------------------------------------
    def prepare(self) -> JobStore:
        """Make the state dir (0700) and open the store."""
        self.paths.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.paths.root, 0o700)
        for d in (self.paths.runs, self.paths.logs, self.paths.configs):
            d.mkdir(exist_ok=True)
        self.store = JobStore(self.paths.db)
        return self.store

    async def settle_leftovers(self) -> None:
        """Settle the jobs a previous daemon left running: each one's process stopped (it
        checkpoints on SIGTERM: up to `stop_timeout` s, off the event loop, so the daemon
        answers meanwhile); one with summary.json finished, a cancelled one cancelled, any
        other back to the queue."""
        assert self.store is not None
        left = self.store.list(("running",))
        await asyncio.gather(*(asyncio.to_thread(jobproc.stop_leftover, job, self.stop_timeout)
                               for job in left))
        for job in left:
            if (Path(job.run_dir) / "summary.json").exists():
                self.store.update(job.id, state="finished", pid=None, exit_code=0,
                                  finished=time.time())
            elif self.store.get(job.id).cancel_requested:  # before or while it stopped
                self.store.update(job.id, state="cancelled", pid=None, finished=time.time())
            else:
                self.store.update(job.id, state="queued", pid=None)
                log.warning("job interrupted by a daemon restart; requeued", job=job.id)

    async def serve(self) -> int:
        store = self.prepare()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._request_stop, signal.Signals(sig).name)
        loop.add_signal_handler(signal.SIGHUP, self.reopen_log)
        self.paths.socket.unlink(missing_ok=True)
        old_umask = os.umask(0o177)  # the socket file is created owner-only
        try:
            server = await asyncio.start_unix_server(self._client, path=str(self.paths.socket),
                                                     limit=MAX_REQUEST_BYTES)
        finally:
            os.umask(old_umask)
        log.info("daemon serving", state_dir=str(self.paths.root), pid=os.getpid(),
                 queued=store.counts()["queued"], left_running=store.counts()["running"])
        settling = asyncio.create_task(self.settle_leftovers())
        try:
            while not self.stopping.is_set():
                self._reap()
                if settling.done():  # no new job beside one a previous daemon left running
                    settling.result()
                    self._start_queued()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), self.poll_s)
            await settling
            await self._stop_children()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
            server.close()
            self.paths.socket.unlink(missing_ok=True)
            store.close()
        log.info("daemon stopped")
        return 0

    def _request_stop(self, why: str) -> None:
        log.info("daemon stop requested", signal=why)
        self.stopping.set()

    def reopen_log(self) -> None:
        """Point stdout/stderr at a freshly opened log file (after a rotation)."""
        if self.log_file is None:
            return
        fd = os.open(self.log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        log.info("log reopened", path=str(self.log_file))

    # ---- scheduling ------------------------------------------------------------------
    def _reap(self) -> None:
        assert self.store is not None
        for job_id, popen in list(self.children.items()):
            rc = popen.poll()
            if rc is None:
                continue
            del self.children[job_id]
            job = self.store.get(job_id)
            done = rc == 0 and (Path(job.run_dir) / "summary.json").exists()
            if self.stopping.is_set() and not job.cancel_requested and not done:
                self.store.update(job_id, state="queued", pid=None)
                log.info("job stopped with the daemon; requeued", job=job_id, exit_code=rc)
                continue
            # a cancelled run stops cleanly (checkpoint, exit 0): still cancelled, not finished
            state = "cancelled" if job.cancel_requested else "finished" if rc == 0 else "failed"
            error = "" if rc == 0 or job.cancel_requested else jobproc.job_error(
                Path(job.log_path), rc)
            self.store.update(job_id, state=state, exit_code=rc, pid=None, error=error,
                              finished=time.time())
            log.info("job ended", job=job_id, state=state, exit_code=rc)

    def _start_queued(self) -> None:
        assert self.store is not None
        for job in self.store.list(("queued",)):
            if len(self.children) >= self.max_jobs:
                return
            cmd, step = jobproc.job_command(job, self.paths.configs)
            popen = jobproc.start_job(cmd, Path(job.log_path))
            self.children[job.id] = popen
            self.store.update(job.id, state="running", pid=popen.pid,
                              pid_started=jobproc.create_time(popen.pid),
                              attempts=job.attempts + 1, resumed_from=step,
                              started=time.time(), exit_code=None)
            log.info("job started", job=job.id, pid=popen.pid, resumed_from=step)

    async def _stop_children(self) -> None:
        assert self.store is not None
        for popen in self.children.values():
            jobproc.signal_group(popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout
        while any(p.poll() is None for p in self.children.values()):
            if time.monotonic() > deadline:
                for p in self.children.values():
                    jobproc.signal_group(p.pid, signal.SIGKILL)
            await asyncio.sleep(0.1)
        self._reap()  # requeues them (cancelled ones settle as cancelled)

    # ---- control socket --------------------------------------------------------------
    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await reader.readline()
            try:
                request = json.loads(line)
                if not isinstance(request, dict):
                    raise TypeError("a request is a JSON object")
                result = await self._scale(request) if request.get("op") == "scale" \
                    else self.handle(request)
                reply = {"ok": True, "result": result}
            except (ValueError, KeyError, TypeError) as e:
                # a KeyError's str() is its key's repr: send the key itself, every other
                # message whole (stripping quotes cut the last one off messages ending in it)
                error = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
                reply = {"ok": False, "error": error}
            writer.write(json.dumps(reply).encode() + b"\n")
            await writer.drain()
        except (ConnectionError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            writer.close()

    def handle(self, request: dict[str, Any]) -> Any:
        assert self.store is not None
        op = request.get("op")
        if op == "ping":
            return {"pid": os.getpid(), "state_dir": str(self.paths.root)}
        if op == "submit":
            return self._submit(request).to_dict()
        if op == "jobs":
            return [j.to_dict() for j in self.store.list()]
        if op in ("job", "cancel"):
            job = self._job(request.get("id"))
            return (self._cancel(job) if op == "cancel" else job).to_dict()
        raise ValueError(f"unknown op {op!r}; accepted: ping, submit, jobs, job, cancel, scale")

    async def _scale(self, request: dict[str, Any]) -> dict[str, Any]:
        """`{"op": "scale", "id": N, "generators": 2, "scorers": 1}`: the running job's
        coordinator adds or retires processes (control/scale.py); answered once it has."""
        # torch (control/'s messages): the daemon loads it only when a job is scaled
        from rlhf_async.control.reshape import KEYS, ReshapeError, Scale
        from rlhf_async.runtime.messages import to_payload
        from rlhf_async.strategies.registry import request_scale

        job = self._job(request.get("id"))
        unknown = sorted(set(request) - {"op", "id", "timeout", *KEYS})
        counts = {k: request[k] for k in KEYS if k in request}
        if unknown or not all(type(v) is int for v in counts.values()):
            raise ValueError(f"scale takes id, timeout and whole-number {' and '.join(KEYS)}"
                             + (f"; unknown: {', '.join(unknown)}" if unknown else ""))
        if job.state != "running":
            raise ValueError(f"job {job.id} is {job.state}: only a running job scales")
        timeout = request.get("timeout", 300.0)
        if not isinstance(timeout, int | float) or timeout <= 0:
            raise ValueError(f"scale's timeout must be a positive number of seconds, got "
                             f"{timeout!r}")
        try:
            scaled = await request_scale(Path(job.run_dir), Scale(**counts), float(timeout))
        except ReshapeError as e:
            raise ValueError(f"job {job.id}: {e}") from None
        return {"job": job.id, **to_payload(scaled)}

    def _job(self, job_id: Any) -> Job:
        assert self.store is not None
        if type(job_id) is not int:
            raise ValueError(f"job id must be an integer, got {job_id!r}")
        try:
            return self.store.get(job_id)
        except KeyError:
            raise ValueError(f"no job {job_id}") from None

    def _submit(self, request: dict[str, Any]) -> Job:
        assert self.store is not None
        text, name = request.get("config_text", ""), request.get("config_name", "")
        overrides, cwd = request.get("overrides", []), request.get("cwd", "")
        if not isinstance(text, str) or not isinstance(name, str) or not isinstance(
                overrides, list) or not all(isinstance(o, str) for o in overrides):
            raise ValueError("submit takes config_text and config_name strings and a list "
                             "of key=value override strings")
        if not isinstance(cwd, str) or (cwd and not os.path.isabs(cwd)):
            raise ValueError(f"submit's cwd must be an absolute directory, got {cwd!r}")
        try:  # reject a bad config now, not when its turn comes; paths as the job will see
            load_config((name or "submitted config") if text else None, overrides,
                        text=text or None, base_dir=cwd or None)
        except ConfigError as e:
            raise ValueError(str(e)) from None
        job = self.store.add(name, text, overrides, self.paths.runs, self.paths.logs, cwd)
        log.info("job submitted", job=job.id, config=name, overrides=overrides, cwd=cwd)
        return job

    def _cancel(self, job: Job) -> Job:
        assert self.store is not None
        if job.state in DONE_STATES:
            raise ValueError(f"job {job.id} already {job.state}")
        self.store.update(job.id, cancel_requested=1)
        if job.state == "queued":
            self.store.update(job.id, state="cancelled", finished=time.time())
        elif job.id in self.children:
            jobproc.signal_group(self.children[job.id].pid, signal.SIGTERM)
        return self.store.get(job.id)
