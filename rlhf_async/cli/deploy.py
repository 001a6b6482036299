"""Deployment subcommands: the daemon (serve, submit, jobs, logs, cancel) and the Ray
cluster's pre-flight (doctor). `rlhf-async COMMAND --help` for each."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rlhf_async.cli.args import split_config
from rlhf_async.cli.errors import UserError
from rlhf_async.config import config_from_dict, load_config
from rlhf_async.log import configure_logging
from rlhf_async.ops.daemon.client import call_daemon
from rlhf_async.ops.daemon.metrics import serve_metrics
from rlhf_async.ops.daemon.server import Daemon, DaemonError, StatePaths


def default_state_dir() -> Path:
    env = os.environ.get("RLHF_ASYNC_STATE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base) / "rlhf-async"


def add_commands(sub: Any) -> None:
    state_help = "daemon state directory (default $RLHF_ASYNC_STATE_DIR or " \
                 "~/.local/state/rlhf-async)"
    serve = sub.add_parser("serve", help="run the job daemon (until SIGTERM)")
    serve.add_argument("--max-jobs", type=int, default=1, help="jobs run at the same time")
    serve.add_argument("--metrics-port", type=int, default=0,
                       help="serve Prometheus /metrics on 127.0.0.1:PORT (0: off)")
    serve.add_argument("--log-file", type=Path, help="append logs here; SIGHUP reopens it")
    serve.add_argument("--stop-timeout", type=float, default=60.0,
                       help="seconds a job gets to stop on SIGTERM before SIGKILL")
    serve.add_argument("--log-level", default="info",
                       choices=("debug", "info", "warning", "error"))
    serve.add_argument("--api", metavar="HOST:PORT", help="also serve the Tinker training API "
                       "there (needs aiohttp; README: Tinker API); its key: "
                       "$RLHF_ASYNC_API_KEY or --api-key-file")
    serve.add_argument("--api-key-file", type=Path, help="file holding the API key (tml-...)")
    submit = sub.add_parser("submit", help="queue a job on the daemon")
    submit.add_argument("config", nargs="?", help="TOML config file (optional)")
    submit.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides")
    jobs = sub.add_parser("jobs", help="list the daemon's jobs, or show one")
    jobs.add_argument("job", nargs="?", type=int, help="job id")
    jobs.add_argument("--json", action="store_true", help="machine-readable output")
    logs = sub.add_parser("logs", help="print a job's output")
    logs.add_argument("job", type=int)
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing until it ends")
    cancel = sub.add_parser("cancel", help="cancel a queued or running job")
    cancel.add_argument("job", type=int)
    for p in (serve, submit, jobs, logs, cancel):
        p.add_argument("--state-dir", type=Path, default=None, help=state_help)

    doctor = sub.add_parser("doctor", help="check the Ray cluster a job would run on (its "
                            "placement, versions, shared directories, reachability) before it "
                            "starts")
    doctor.add_argument("config", nargs="?", help="TOML config file, or a run directory "
                        "(its config.json, as `resume` would run it)")
    doctor.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides")
    doctor.add_argument("--timeout", type=float, default=60.0,
                        help="seconds each Ray node gets to answer")


def _state(args: argparse.Namespace) -> Path:
    return args.state_dir if args.state_dir is not None else default_state_dir()


def _call(args: argparse.Namespace, request: dict[str, Any]) -> Any:
    try:
        return call_daemon(_state(args), request)
    except DaemonError as e:
        raise UserError(str(e)) from None


def cmd_serve(args: argparse.Namespace) -> int:
    from rlhf_async.runtime import run_loop  # torch: only the commands that run a loop load it

    if args.max_jobs < 1:
        raise UserError(f"--max-jobs must be >= 1, got {args.max_jobs}")
    daemon = Daemon(_state(args), max_jobs=args.max_jobs, stop_timeout=args.stop_timeout,
                    log_file=args.log_file)
    if args.log_file is not None:
        try:
            daemon.reopen_log()
        except OSError as e:
            raise UserError(f"--log-file {args.log_file}: {e.strerror}") from None
    configure_logging(args.log_level)
    if StatePaths(daemon.paths.root).socket.exists():
        try:
            call_daemon(daemon.paths.root, {"op": "ping"}, timeout=2.0)
        except DaemonError:
            pass  # a stale socket of a dead daemon
        else:
            raise UserError(f"a daemon already serves {daemon.paths.root}")
    if args.metrics_port:
        try:
            serve_metrics(daemon.paths.db, args.metrics_port)
        except OSError as e:
            raise UserError(f"--metrics-port {args.metrics_port}: {e.strerror}") from None
    if args.api:
        return _serve_api(args, daemon)
    return int(run_loop(daemon.serve()))


def _serve_api(args: argparse.Namespace, daemon: Daemon) -> int:
    """The daemon with the Tinker API beside it (ops/tinker/), in one event loop."""
    try:  # here, not at the top: aiohttp is the [tinker-api] extra's
        from rlhf_async.ops.tinker.server import ApiConfigError, ApiServer, parse_address, read_key
        from rlhf_async.ops.tinker.service import TinkerService
        from rlhf_async.runtime import run_loop
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "aiohttp":
            raise
        raise UserError("--api needs aiohttp: pip install 'rlhf-async[tinker-api]'") from None
    try:
        host, port = parse_address(args.api)
        key = read_key(os.environ.get("RLHF_ASYNC_API_KEY"), args.api_key_file)
        api = ApiServer(TinkerService(daemon.paths.root), host, port, key)
        return int(run_loop(api.run_beside(daemon.serve())))
    except ApiConfigError as e:
        raise UserError(str(e)) from None


def cmd_submit(args: argparse.Namespace) -> int:
    config, overrides = split_config(args)
    text, name = "", ""
    if config is not None:
        try:
            text, name = Path(config).read_text(), str(Path(config).resolve())
        except OSError as e:
            raise UserError(f"cannot read config {config}: {e.strerror}") from None
    job = _call(args, {"op": "submit", "config_text": text, "config_name": name,
                       "overrides": overrides, "cwd": os.getcwd()})
    print(f"job {job['id']} queued (run dir {job['run_dir']})")
    return 0


def _when(t: float | None) -> str:
    return "-" if t is None else datetime.fromtimestamp(t, UTC).strftime("%m-%d %H:%M:%S")


def cmd_jobs(args: argparse.Namespace) -> int:
    result = _call(args, {"op": "job", "id": args.job} if args.job is not None else
                   {"op": "jobs"})
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    rows = [result] if args.job is not None else result
    print(f"{'job':>5} {'state':<10} {'tries':>5} {'resumed':>7} {'submitted':<15} "
          f"{'finished':<15} config")
    for j in rows:
        resumed = "-" if j["resumed_from"] is None else str(j["resumed_from"])
        config = " ".join([Path(j["config_name"]).name or "(built-in)", *j["overrides"]])
        print(f"{j['id']:>5} {j['state']:<10} {j['attempts']:>5} {resumed:>7} "
              f"{_when(j['submitted']):<15} {_when(j['finished']):<15} {config}")
        if j["error"]:
            print("      error: " + j["error"].replace("\n", "\n             "))
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    job = _call(args, {"op": "job", "id": args.job})
    path = Path(job["log_path"])
    if not path.exists():
        print(f"job {args.job} has no output yet ({job['state']})", file=sys.stderr)
        return 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(65536)
            if chunk:
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
                continue
            if not args.follow or job["state"] not in ("queued", "running"):
                return 0
            time.sleep(0.5)
            job = _call(args, {"op": "job", "id": args.job})


def cmd_cancel(args: argparse.Namespace) -> int:
    job = _call(args, {"op": "cancel", "id": args.job})
    print(f"job {job['id']}: " + ("cancelled" if job["state"] == "cancelled" else
                                  "cancel requested; its processes are stopping"))
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    # torch and Ray: only `doctor` loads them
    from rlhf_async.engines.extras import MissingExtraError
    from rlhf_async.ops.doctor import check_cluster
    from rlhf_async.runtime.ray_cluster import RayPlacementError

    configure_logging("error")
    config, overrides = split_config(args)
    if config is not None and Path(config).is_dir():
        if overrides:
            raise UserError(f"{config} is a run directory: it is checked with its own "
                            "config.json; give no key=value")
        try:
            cfg = config_from_dict(json.loads((Path(config) / "config.json").read_text()))
        except (OSError, ValueError) as e:
            raise UserError(f"{config} is not a run directory with a readable config.json "
                            f"({e})") from None
    else:
        cfg = load_config(config, overrides)
    try:
        findings = check_cluster(cfg, args.timeout)
    except (MissingExtraError, RayPlacementError) as e:
        raise UserError(str(e)) from None
    for f in findings:
        print(f.line())
    bad = sum(not f.ok for f in findings)
    print(f"{len(findings) - bad} of {len(findings)} checks passed" +
          (f"; {bad} failed" if bad else ""))
    return 1 if bad else 0


HANDLERS = {"serve": cmd_serve, "submit": cmd_submit, "jobs": cmd_jobs, "logs": cmd_logs,
            "cancel": cmd_cancel, "doctor": cmd_doctor}
