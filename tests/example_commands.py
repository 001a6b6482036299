"""The `rlhf-async run ...` command an example's README (or a how-to) shows, as the
arguments after `run`: what tests load and run, so a documented command stays one that
works."""

from __future__ import annotations

import re
import shlex
from pathlib import Path


def readme_command(path: Path) -> list[str]:
    """The first `rlhf-async run` line in the bash blocks of `path`, continuation lines
    joined, as arguments after `run`."""
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip().startswith("rlhf-async run"):
                return shlex.split(line)[2:]
    raise AssertionError(f"{path}: no `rlhf-async run` line in a bash block")
