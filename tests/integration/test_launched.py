"""Flattening started by torchrun, one `rlhf-async run` per rank: the job the built-in
launch runs, step for step."""

import json
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from rlhf_async.wire.local import free_tcp_port

pytestmark = pytest.mark.timeout(300)
TINY = ["model.hidden=32", "model.layers=1", "model.heads=2", "sft.steps=20",
        "reward_model.steps=20", "reward_model.heldout_pairs=64", "run.eval_prompts=16",
        "train.steps=5", "train.prompts_per_step=4", "algo.group_size=2", "run.plot=false",
        "placement.cpu_threads=1", "run.progress=false", "placement.strategy=flattening"]
TIMES = {"time_step", "time_generate", "time_score", "time_train", "samples_per_s",
         "tokens_per_s_per_device", "mfu/generate", "mfu/score", "mfu/train", "mfu/step"}


def _torchrun(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           "2", "--master-port", str(free_tcp_port()), "-m", "rlhf_async",
                           *args], capture_output=True, text=True, timeout=240, check=False)


def _metrics(run_dir):
    return [{k: v for k, v in json.loads(x).items() if k not in TIMES}
            for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_torchrun_ranks_run_the_built_in_launchs_trajectory(tmp_path, cache):
    common = [*TINY, f"run.output_dir={tmp_path}", f"run.cache_dir={cache}"]
    built_in = subprocess.run([sys.executable, "-m", "rlhf_async", "run", *common,
                               "placement.devices=2", "run.name=built-in"],
                              capture_output=True, text=True, timeout=240, check=False)
    assert built_in.returncode == 0, built_in.stderr[-2000:]
    # placement.devices comes from WORLD_SIZE; the other rank trains nothing of its own
    p = _torchrun("run", *common, "run.name=launched")
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert p.stdout.count("hidden score on 16 held-out prompts") == 1  # rank 0 reports
    launched, built = tmp_path / "launched", tmp_path / "built-in"
    assert _metrics(launched) == _metrics(built) and len(_metrics(launched)) == 5
    a = load_file(launched / "policy" / "model.safetensors")
    b = load_file(built / "policy" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert "flattening on 2 cpu" in (launched / "placement.txt").read_text()
    # resuming the finished run: rank 0 says so, every rank exits 0 at once
    again = _torchrun("resume", str(launched))
    assert again.returncode == 0 and "already finished" in again.stdout, again.stderr[-2000:]


def test_under_a_launcher_separation_is_refused_in_one_line(tmp_path):
    """(a wrong device count and a malformed RANK: tests/unit/job/test_launched.py)"""
    p = _torchrun("run", *TINY, "placement.strategy=separation", f"run.output_dir={tmp_path}")
    assert p.returncode != 0
    assert "rlhf-async run: error:" in p.stderr
    assert "separation starts its own node processes" in p.stderr
    # torchrun prints its own traceback when a rank fails; none of ours is in it
    assert not [x for x in p.stderr.splitlines() if x.strip().startswith('File "') and
                "rlhf_async" in x]
    assert not any(tmp_path.iterdir())
