"""DeepSpeed ZeRO training backend on CPU (gloo): same trajectory as the torch backend.

Every DeepSpeed run is its own process (DeepSpeed owns a default process group and env for
its lifetime). On CPU the collectives go through gloo (DeepSpeed's shm op, a JIT compile
per environment, is skipped: `skip_shm_op_on_cpu`). The `test` extra installs deepspeed,
so CI runs these for real.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_separation import _run, _weights
from tests.policies import assert_same_policy

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                 reason="deepspeed is not installed "
                                        "(pip install 'rlhf-async[deepspeed]')")]
ROOT = Path(__file__).resolve().parents[2]


def _learner_run(tmp_path, backend, stage=2, accum=1, algo="ppo"):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    ck = tmp_path / f"{backend}-{stage}-{accum}-{algo}"
    p = subprocess.run([sys.executable, "-m", "tests.integration.ds_learner_run", backend,
                        str(stage), str(accum), algo, str(ck)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=500, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def torch_ppo(tmp_path_factory):
    return _learner_run(tmp_path_factory.mktemp("torch"), "torch")


def _same(a, b, keys):
    for ra, rb in zip(a["metrics"], b["metrics"], strict=True):
        for k in keys:
            assert ra[k] == pytest.approx(rb[k], rel=1e-4, abs=1e-5), k
    assert a["weights"].keys() == b["weights"].keys()
    for k, v in a["weights"].items():
        assert v == pytest.approx(b["weights"][k], rel=1e-4, abs=1e-4), k


KEYS = ["policy_loss", "value_loss", "entropy", "reward", "kl", "actor_grad_norm",
        "critic_grad_norm"]


@pytest.mark.parametrize("stage,accum", [(2, 1), (3, 2)])
def test_zero_learner_matches_torch_and_resumes_exactly(tmp_path, torch_ppo, stage, accum):
    ds = _learner_run(tmp_path, "deepspeed", stage, accum)
    _same(torch_ppo, ds, KEYS)
    # restored from our checkpoint format, the step repeats bit for bit
    assert ds["resume_max_diff"] == 0.0
    assert ds["repeat_metrics"] == ds["metrics"][2]


def test_separation_trainer_on_zero3_matches_flattening_on_torch(tmp_path, cache, one_thread):
    """A 2-rank ZeRO-3 trainer (parameters sharded over its ranks, gathered for each
    broadcast and the final save) with 2 generators and 2 scorers."""
    _, flat = _run(tmp_path, cache, "flat", "algo.name=ppo")
    _, sep = _run(tmp_path, cache, "sep", "algo.name=ppo", "placement.strategy=separation",
                  "placement.devices=4", "placement.actor=[0,1]", "placement.generators=2",
                  "placement.scorers=2", "algo.max_staleness=0", "train.backend=deepspeed",
                  "train.zero_stage=3")
    assert len(flat) == len(sep) == 3
    for a, b in zip(flat, sep, strict=True):
        for k in ["policy_loss", "value_loss", "reward", "kl", "entropy"]:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-5), (a["step"], k)
    wf, ws = _weights(tmp_path, "flat"), _weights(tmp_path, "sep")
    # Adam on ZeRO's flat fp32 buffer vs per-tensor: last-ulp gradient differences move
    # near-zero-gradient weights by a fraction of one step (lr 5e-4)
    assert_same_policy(wf, ws, atol=2e-4)


def test_flattening_two_ranks_on_zero3_matches_torch(tmp_path, cache, one_thread):
    """Two Flattening ranks over gloo: DeepSpeed joins the existing group, sums gradients
    like the torch backend, and ZeRO-3 generation gathers the sharded actor per forward."""
    _, ref = _run(tmp_path, cache, "torch", "placement.devices=2")
    _, ds = _run(tmp_path, cache, "zero3", "placement.devices=2", "train.backend=deepspeed",
                 "train.zero_stage=3")
    assert len(ref) == len(ds) == 3
    for a, b in zip(ref, ds, strict=True):
        for k in ["policy_loss", "value_loss", "reward", "kl", "entropy"]:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-5), (a["step"], k)


def test_zero3_broadcast_gathers_one_bucket_at_a_time(tmp_path, monkeypatch):
    """Two ZeRO-3 ranks walk the actor's shards in lock-step: rank 0 broadcasts each gathered
    group before the next is gathered, so at most one bucket (or one larger tensor) of
    sharded weights is whole at once, never the model; the receiver gets the trainer's
    tensors bit for bit, tied aliases and state_dict order included. A broadcast that
    fails half way still completes the walk: the follower stays in step."""
    from tests.integration import ds_walk_run

    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    # hidden 256: the large matrices pass DeepSpeed's persistence threshold (1e5
    # elements), so they are really sharded; 512 KiB buckets: five gathered groups
    r = ds_walk_run.run(256, 512, str(tmp_path))
    assert r["identical"] and r["tied"] and r["names"] == r["state_dict_names"]
    walk, bound = r["walk"], max(r["bucket_bytes"], r["largest_tensor_bytes"])
    assert len(walk) >= 4 and r["model_shard_bytes"] > 2 * bound
    assert max(whole for whole, _ in walk) <= bound  # never the whole model
    assert r["largest_group_bytes"] <= bound
    sent = [s for _, s in walk]
    assert sent == sorted(sent) and sent[-1] >= r["total_bytes"] - 2 * bound  # interleaved
    assert r["sent"] == r["total_bytes"]
