"""DeepSpeed ZeRO and vLLM engines on a GPU. Skips without CUDA or without the extras.

Run by bench/gpu_check.sh on a GPU machine; on CPU every test here is skipped."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _has(mod: str) -> bool:
    return importlib.util.find_spec(mod) is not None


@needs_cuda
@pytest.mark.skipif(not _has("deepspeed"), reason="deepspeed is not installed")
def test_zero3_learner_on_gpu_resumes_exactly(tmp_path):
    env = {**os.environ, "DS_ACCELERATOR": "cuda"}
    p = subprocess.run([sys.executable, "-m", "tests.integration.ds_learner_run", "deepspeed",
                        "3", "2", "ppo", str(tmp_path / "ck")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=400, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["resume_max_diff"] == 0.0


@needs_cuda
@pytest.mark.skipif(not _has("vllm"), reason="vllm is not installed")
def test_the_vllm_engine_tests_pass_on_cuda():
    # tests/vllm on the real vllm: served log-probs follow the sent weights, versions at
    # the swap point, abort, pause/resume
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/vllm"], cwd=ROOT,
                       capture_output=True, text=True, timeout=900, check=False)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-2000:])
