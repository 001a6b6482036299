"""Where and how a benchmark writes: its summary under bench/results/ (committed, cited by
bench/README.md) and its raw traces (per-step curves, samples) under runs/ (ignored), so the
committed summaries stay small. Every summary is one JSON object with a `meta` block that
says what ran, where and under what load (`meta`), beside the benchmark's own fields."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.suite import by_script

ROOT = Path(__file__).resolve().parents[1]


def traces_path(out: Path, given: str | Path | None, what: str) -> Path:
    """`given`, or runs/<the summary's name>_<what>.json."""
    return Path(given) if given else Path("runs") / f"{out.stem}_{what}.json"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):  # no git here: the summary says so
        return ""


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name")), platform.processor())
    except OSError:  # not Linux
        return platform.processor()


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ""


def meta(argv: list[str] | None = None) -> dict[str, Any]:
    """What every summary records about its run: the benchmark (by the script that ran), its
    command line, when (UTC), the commit, the host's cores, CPU and load average, and the
    Python and torch versions."""
    argv = sys.argv if argv is None else argv
    bench = by_script(Path(argv[0]).name) if argv else None
    return {"bench": bench.name if bench else Path(argv[0]).stem if argv else "",
            "command": " ".join(argv),
            "utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S"),
            "commit": _commit(), "cores": os.cpu_count(), "cpu": _cpu(),
            "loadavg": [round(x, 2) for x in os.getloadavg()],
            "python": platform.python_version(), "torch": _version("torch")}


def write_json(path: Path | str, body: dict[str, Any], indent: int = 1) -> None:
    """The summary `body` with this run's `meta` first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta(), **body}, indent=indent) + "\n")
