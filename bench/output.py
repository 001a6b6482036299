"""Where a benchmark writes: its summary under bench/results/ (committed, cited by
bench/README.md) and its raw traces (per-step curves, samples) under runs/ (ignored), so the
committed summaries stay small."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def traces_path(out: Path, given: str | Path | None, what: str) -> Path:
    """`given`, or runs/<the summary's name>_<what>.json."""
    return Path(given) if given else Path("runs") / f"{out.stem}_{what}.json"


def write_json(path: Path, body: dict[str, Any], indent: int = 1) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=indent))
