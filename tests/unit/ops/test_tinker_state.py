"""The Tinker API's persisted records (ops/tinker/state.py): a model's next seq_id journal
survives a kill mid-write and starts afresh when long; unreadable records are skipped; a
session whose client stopped beating ends."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from rlhf_async.ops.tinker import schema, state
from rlhf_async.ops.tinker.base_models import BUILTIN
from rlhf_async.ops.tinker.futures import ApiError
from rlhf_async.ops.tinker.service import SESSION_IDLE_S, TinkerService
from rlhf_async.ops.tinker.state import ModelRecord, Session, Store


def test_the_seq_journal_gives_the_newest_next_seq(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state, "JOURNAL_MAX", 64)
    store = Store(tmp_path)
    rec = ModelRecord("s-1:train:0", "s-1", "m", {"rank": 0, "seed": 0}, next_seq=3)
    store.save_model(rec)
    assert store.next_seq(rec) == 3  # nothing journalled yet: the record's
    for n in range(4, 60):
        store.append_seq(rec.id, n)
    journal = next(tmp_path.glob("models_state/*.seq"))
    assert len(journal.read_text()) <= 64 + 3  # started afresh on the way
    with journal.open("a") as f:
        f.write("6")  # a kill in the middle of a line: "60" half written
    store.close()
    assert Store(tmp_path).next_seq(rec) == 59


def test_records_round_trip_and_a_torn_one_is_skipped(tmp_path: Path) -> None:
    store = Store(tmp_path)
    store.save_session(Session("session-a", "0.38.0", 1.0, 2.0))
    store.save_model(ModelRecord("session-a:train:0", "session-a", "m", {"rank": 4, "seed": 1},
                                 origin="tinker://r/weights/x", changed=True))
    (tmp_path / "models_state" / "broken.json").write_text('{"id": "x", "sess')
    (tmp_path / "models_state" / "partial.json").write_text('{"id": "y"}')
    again = Store(tmp_path)
    assert [s.id for s in again.sessions()] == ["session-a"]
    [model] = again.models()
    assert model.origin == "tinker://r/weights/x" and model.changed and model.lora["rank"] == 4


def test_a_session_without_heartbeats_ends_and_releases_its_models(tmp_path: Path) -> None:
    async def go() -> None:
        svc = TinkerService(tmp_path, device="cpu")
        sid = svc.create_session(schema.CreateSession(sdk_version="0.38.0"))["session_id"]
        other = svc.create_session(schema.CreateSession(sdk_version="0.38.0"))["session_id"]
        rid = svc.create_model(schema.CreateModel(session_id=sid, model_seq_id=0,
                                                  base_model=BUILTIN))["request_id"]
        assert (await svc.futures.wait(rid, 120)).kind == "json"  # type: ignore[union-attr]
        now = time.time()
        svc.sessions[other].last_seen = now + SESSION_IDLE_S  # its client beats on
        assert svc.expire_idle(now + SESSION_IDLE_S / 2) == []
        assert svc.expire_idle(now + SESSION_IDLE_S + 1) == [sid]
        with pytest.raises(ApiError, match="has finished"):
            svc.session(sid)
        with pytest.raises(ApiError, match="no heartbeat for 30 min"):
            svc.get_info(schema.ModelRef(model_id=f"{sid}:train:0"))
        svc.session(other)  # still going
        await svc.aclose()
        # a restarted server gives its sessions' clients SESSION_IDLE_S to come back
        again = TinkerService(tmp_path, device="cpu")
        assert again.expire_idle(time.time() + SESSION_IDLE_S / 2) == []
        assert f"{sid}:train:0" not in again.models  # an ended session's: not restored
        await again.aclose()

    asyncio.run(go())
