"""run.report_to = ["tensorboard", "wandb"]: a run's metrics in TensorBoard event files
beside metrics.jsonl, one scalar per metric and step (read back with TensorBoard's own
reader), and in an offline W&B run under RUN_DIR/wandb (when wandb is installed)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from rlhf_async import job
from rlhf_async.config import load_config
from rlhf_async.metrics import read_metrics

pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
pytestmark = [pytest.mark.timeout(300)]


def test_tensorboard_and_wandb_get_every_step_of_a_run(tmp_path, one_thread, monkeypatch):
    """The reporter follows metrics.jsonl, whichever strategy writes it: Flattening here
    (in-process, the quickest); the same file under Separation comes from the coordinator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sinks = ["tensorboard"]
    if importlib.util.find_spec("wandb") is not None:
        monkeypatch.setenv("WANDB_MODE", "offline")  # no network here, nor in CI
        monkeypatch.setenv("WANDB_SILENT", "true")
        sinks.append("wandb")

    cfg = load_config(None, [
        "model.hidden=32", "model.layers=1", "model.heads=2", "sft.steps=20",
        "reward_model.steps=20", "reward_model.heldout_pairs=64", "run.eval_prompts=16",
        "train.steps=3", "train.prompts_per_step=4", "algo.group_size=2", "run.plot=false",
        "run.progress=false", f"run.report_to={json.dumps(sinks)}", f"run.cache_dir={json.dumps(str(tmp_path / 'c'))}",
        f"run.output_dir={json.dumps(str(tmp_path))}", "run.name=tb"])
    job.run(cfg)
    events = EventAccumulator(str(tmp_path / "tb" / "tensorboard"))
    events.Reload()
    records = read_metrics(tmp_path / "tb" / "metrics.jsonl")
    for key in ("reward", "policy_loss", "kl", "samples_per_s"):
        points = events.Scalars(key)
        assert [p.step for p in points] == [0, 1, 2], key
        assert [p.value for p in points] == pytest.approx([r[key] for r in records]), key
    texts = events.Tensors("samples/text_summary")  # samples.jsonl, a table a step
    assert [t.step for t in texts] == [0, 1, 2]
    assert "| prompt | response | reward | advantage | version |" in \
        texts[0].tensor_proto.string_val[0].decode()
    if "wandb" in sinks:  # an offline run, read back record by record
        (log,) = (tmp_path / "tb" / "wandb").glob("offline-run-*/run-*.wandb")
        history = [h for h in _wandb_history(log) if "reward" in h]
        assert [h["_step"] for h in history] == [0, 1, 2]
        assert [h["reward"] for h in history] == pytest.approx([r["reward"] for r in records])


def _wandb_history(path):
    """The history rows of a .wandb file: a 7-byte header, then LevelDB-log records (blocks
    of 32 KiB; each piece: crc32 4, length 2, type 1: full / first / middle / last) of
    protobuf `Record`s."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, parts, rows = path.read_bytes(), 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header: padding
            pos += block - pos % block
            continue
        size, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        parts += data[pos + 7:pos + 7 + size]
        pos += 7 + size
        if kind in (1, 4):  # a whole record, or its last piece
            record = pb.Record()
            record.ParseFromString(parts)
            parts = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                             for i in record.history.item})
    return rows
