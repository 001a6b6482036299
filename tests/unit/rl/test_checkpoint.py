import errno
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlhf_async.config import AlgoConfig, ModelConfig, TaskConfig, TrainConfig
from rlhf_async.modeling.models import load_actor
from rlhf_async.rl import checkpoint
from rlhf_async.rl.checkpoint import (
    CheckpointError,
    DiskFullError,
    list_checkpoints,
    load_latest,
    save_checkpoint,
    verify,
)
from rlhf_async.rl.learner import Learner
from rlhf_async.task.sort_digits import VOCAB_SIZE, SortDigitsTask


def _state(x: float):
    return {"w": torch.full((4, 4), x), "opt": {"state": {0: {"exp_avg": torch.ones(3) * x}},
                                               "param_groups": [{"lr": 0.1, "params": [0]}]}}


def test_round_trip_and_pruning(tmp_path):
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, _state(step), {"version": step}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-00000003", "ckpt-00000004"]
    ck = load_latest(tmp_path)
    assert ck.step == 4 and ck.meta["version"] == 4
    assert torch.equal(ck.state["w"], torch.full((4, 4), 4.0))
    assert ck.state["opt"]["state"][0]["exp_avg"].tolist() == [4.0, 4.0, 4.0]
    assert not list(tmp_path.glob(".tmp-*"))  # nothing half-written left behind


def test_truncated_checkpoint_is_detected_and_the_previous_one_used(tmp_path):
    save_checkpoint(tmp_path, 1, _state(1), {})
    newest = save_checkpoint(tmp_path, 2, _state(2), {})
    data = (newest / "state.pt").read_bytes()
    (newest / "state.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        verify(newest)
    ck = load_latest(tmp_path)
    assert ck.step == 1 and torch.equal(ck.state["w"], torch.full((4, 4), 1.0))


def test_corrupted_bytes_fail_the_checksum(tmp_path):
    newest = save_checkpoint(tmp_path, 5, _state(5), {})
    meta = json.loads((newest / "meta.json").read_text())
    meta["step"] = 6
    text = json.dumps(meta, indent=1)
    (newest / "meta.json").write_text(text[: (newest / "meta.json").stat().st_size].ljust(
        (newest / "meta.json").stat().st_size))
    with pytest.raises(CheckpointError, match="checksum|bytes"):
        verify(newest)
    assert load_latest(tmp_path) is None


def _enospc_inside_torch(state, f):
    """What torch.save does on a full disk: the OSError of a write, then a RuntimeError
    raised while the zip writer closes."""
    f.write(b"PK" * 100)
    try:
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError:
        raise RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos") \
            from None


@pytest.mark.parametrize("where", ["state.pt", "meta.json"])
def test_a_full_disk_is_one_error_and_the_previous_checkpoint_stays(tmp_path, monkeypatch,
                                                                     where):
    run = tmp_path / "run"
    save_checkpoint(run / "checkpoints", 2, _state(2), {"version": 2})
    monkeypatch.setattr(shutil, "disk_usage", lambda p: SimpleNamespace(free=1536))
    if where == "state.pt":
        monkeypatch.setattr(checkpoint.torch, "save", _enospc_inside_torch)
    else:
        write = Path.write_text

        def full(self, text, *a, **k):
            if self.name == "meta.json":
                raise OSError(errno.ENOSPC, "No space left on device")
            return write(self, text, *a, **k)
        monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(DiskFullError) as e:
        save_checkpoint(run / "checkpoints", 4, _state(4), {"version": 4}, keep=1)
    assert str(e.value) == (
        f"no space left on device writing {run / 'checkpoints' / 'ckpt-00000004'}: 1.5 KiB "
        "free there; the newest checkpoint, ckpt-00000002, is intact: free some space, then "
        f"continue with `rlhf-async resume {run}`")
    assert isinstance(e.value, CheckpointError)  # the CLI's one-line errors
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["ckpt-00000002"]  # no .tmp
    ck = load_latest(run / "checkpoints")
    assert ck.step == 2 and torch.equal(ck.state["w"], torch.full((4, 4), 2.0))


def test_other_write_errors_pass_through_and_a_quota_is_named(tmp_path, monkeypatch):
    def denied(state, f):
        raise PermissionError(errno.EACCES, "Permission denied")
    monkeypatch.setattr(checkpoint.torch, "save", denied)
    with pytest.raises(PermissionError):
        save_checkpoint(tmp_path, 1, _state(1), {})
    quota = checkpoint.disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"), tmp_path / "x")
    assert quota is not None and str(quota).startswith(f"disk quota exceeded writing "
                                                       f"{tmp_path / 'x'}: ")
    assert checkpoint.disk_full(ValueError("no"), tmp_path) is None


def test_a_checkpoint_of_another_model_size_is_one_error_naming_the_model_keys():
    def learner(hidden: int) -> Learner:
        actor = load_actor(ModelConfig(hidden=hidden, heads=2, layers=1), VOCAB_SIZE,
                           SortDigitsTask(TaskConfig()).special, seed=0)
        return Learner(actor, None, AlgoConfig(name="grpo"), TrainConfig(), seed=0)

    state = checkpoint.learner_state(learner(16))
    with pytest.raises(CheckpointError, match=r"checkpoint's actor does not fit "
                       r"this run's model \(were the model\.\* keys changed"):
        checkpoint.restore_learner(learner(32), state)
    checkpoint.restore_learner(learner(16), state)  # the same model: restored
