"""bench/gpu_check.sh --dry-run runs end to end on CPU (tiny sizes) and writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.timeout(600)]


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PY": sys.executable, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run", "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=580,
                       check=False)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    res = json.loads(out.read_text())
    assert res["dry_run"] is True and res["device"] == "cpu"
    for section in ("generation", "weight_sync", "ppo_step"):
        assert "error" not in res[section], res[section]
    assert res["weight_sync"]["broadcast_s"] > 0
    assert res["ppo_step"]["flattening_step_s"] > 0 and res["ppo_step"]["separation_step_s"] > 0
    mfu = json.loads(out.with_name("gpu_check_mfu.json").read_text())
    for section in ("mfu_builtin", "mfu_smollm2"):
        assert "error" not in mfu[section], mfu[section]
        assert 0 < mfu[section]["mfu/step"] < 1


def test_gpu_check_rejects_unknown_arguments():
    p = subprocess.run(["bash", "bench/gpu_check.sh", "--bogus"], cwd=ROOT, capture_output=True,
                       text=True, timeout=30, check=False)
    assert p.returncode == 2 and "accepted: --dry-run, --out FILE" in p.stderr
