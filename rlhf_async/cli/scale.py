"""`rlhf-async scale RUN_DIR generators=N scorers=M`: add or retire generator and scorer
processes of a running Separation job (control/scale.py asks its coordinator; the job's
side is strategies/separation/scaling.py). The CLI may print; this module is the CLI's."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rlhf_async.cli.errors import UserError
from rlhf_async.wire.security import SecurityError


def add_command(sub: Any) -> None:
    p = sub.add_parser("scale", help="add or retire generator/scorer processes of a running "
                       "separation job (its trainer goes on)")
    p.add_argument("run_dir", type=Path, help="the running job's directory (runs/NAME)")
    p.add_argument("counts", nargs="+", metavar="KEY=N",
                   help="generators=N and/or scorers=M: the process counts wanted")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="longest wait for new processes to load and retired ones to go (s)")


def run(args: argparse.Namespace) -> int:
    # torch (control/'s messages): only the commands that ask a coordinator load it
    from rlhf_async.control.reshape import ReshapeError, parse_scale
    from rlhf_async.runtime import run_loop
    from rlhf_async.strategies.registry import request_scale

    try:
        scale = parse_scale(args.counts)
        scaled = run_loop(request_scale(args.run_dir, scale, args.timeout))
    except (ReshapeError, SecurityError) as e:
        raise UserError(str(e)) from None
    shape = ", ".join(f"{n} {role}(s)" for role, n in scaled.counts.items())
    change = "; ".join(part for part in (
        f"started {', '.join(scaled.added)}" if scaled.added else "",
        f"retired {', '.join(scaled.removed)}" if scaled.removed else "") if part)
    print(f"{args.run_dir}: {change or 'unchanged'}; now {shape} "
          f"(`rlhf-async resume` keeps this shape)")
    return 0
