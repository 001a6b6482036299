"""The commands that need no model start without torch: `rlhf-async version`, `keys`,
`status`, the daemon's client commands and the daemon itself import the CLI (or the
daemon) only, and those import torch, transformers and Ray only in the commands that use
them (ARCHITECTURE.md, "Function-local imports that remain")."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "ray")


@pytest.mark.parametrize("module", ["rlhf_async.cli.main", "rlhf_async.ops.daemon.server"])
def test_importing_the_cli_or_the_daemon_imports_no_heavy_package(module):
    code = (f"import sys, {module}; "
            f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"{module} imports {done.stdout.strip()}"
