import json

import pytest
import torch

from rlhf_async.rl.checkpoint import (
    CheckpointError,
    list_checkpoints,
    load_latest,
    save_checkpoint,
    verify,
)


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
