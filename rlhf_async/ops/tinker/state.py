"""What of the Tinker API outlives its server, under the state directory's `tinker/`:
sessions (`sessions/`), training models (`models_state/`: base model, LoRA setting, the
checkpoint their weights last equalled, whether they trained since, the next `seq_id`)
and sampling sessions made from saved weights (`samplers/`); one small JSON file each,
written atomically. The checkpoints themselves live in `runs/` (checkpoints.py).

A restarted server reads these back (`TinkerService.restore`): a client's session goes
on, a model comes back as its last checkpoint (or as created, from its seed, if never
saved) when nothing was trained since, and otherwise says what was lost.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

from rlhf_async.log import get_logger
from rlhf_async.ops.tinker.base_models import BaseModel, resolve
from rlhf_async.ops.tinker.futures import Sequencer, UserError
from rlhf_async.ops.tinker.training import Lora, TrainedModel
from rlhf_async.rl.checkpoint import CheckpointError, load_latest

log = get_logger(component="tinker_api")
JOURNAL_MAX = 1 << 20  # bytes of a model's seq_id journal before it starts afresh
TINKER_PATH = re.compile(r"^tinker://([A-Za-z0-9._-]+)/(sampler_weights|weights)/([A-Za-z0-9._-]+)$")


@dataclass
class Session:
    id: str
    sdk_version: str
    created: float
    last_seen: float
    finished: bool = False


@dataclass
class ModelRecord:
    """A training model as persisted: enough to make it again."""

    id: str
    session_id: str
    base_model: str
    lora: dict[str, Any]
    created: float = field(default_factory=time.time)
    next_seq: int = 1  # what the client sends next (the highest accepted + 1; the
    # newest is in the model's .seq journal, appended at each request)
    origin: str | None = None  # the checkpoint (tinker://) its weights last equalled
    origin_optimizer: bool = False  # ... with AdamW's state
    changed: bool = False  # trained (gradients or steps) since `origin` / its creation


@dataclass
class ModelEntry:
    id: str
    session_id: str
    base_name: str
    lora: Lora
    seq: Sequencer
    create_rid: str
    base: BaseModel | None = None
    trained: TrainedModel | None = None
    error: str | None = None
    created: float = field(default_factory=time.time)
    samplers: list[str] = field(default_factory=list)  # snapshots, oldest first
    record: ModelRecord | None = None
    restored: bool = False  # made from its record by a restarted server, loaded on first use
    lost: str | None = None  # what a restart lost; requests fail with it until load_weights
    closed: str | None = None  # why it serves no more (its session finished)

    def make_record(self) -> ModelRecord:
        self.record = ModelRecord(self.id, self.session_id, self.base_name,
                                  dataclasses.asdict(self.lora), self.created)
        return self.record


def _file(directory: Path, key: str) -> Path:
    return directory / (key.replace(":", "_").replace("/", "_") + ".json")


class Store:
    """The JSON records; written from the event loop and the model thread (a lock)."""

    def __init__(self, root: Path) -> None:
        self.sessions_dir = root / "sessions"
        self.models_dir = root / "models_state"
        self.samplers_dir = root / "samplers"
        self._lock = threading.Lock()
        self._journals: dict[str, IO[str]] = {}

    def _write(self, path: Path, value: dict[str, Any]) -> None:
        with self._lock:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(value))
            os.replace(tmp, path)

    def save_session(self, s: Session) -> None:
        self._write(_file(self.sessions_dir, s.id), dataclasses.asdict(s))

    def save_model(self, rec: ModelRecord) -> None:
        self._write(_file(self.models_dir, rec.id), dataclasses.asdict(rec))

    def append_seq(self, model_id: str, next_seq: int) -> None:
        """Journal a model's next seq_id: a line appended at each training request (a
        whole record rewritten and renamed each time cost ~2 ms on this box's disk, 7% of
        a tiny model's step); rewritten afresh past JOURNAL_MAX bytes."""
        path = _file(self.models_dir, model_id).with_suffix(".seq")
        with self._lock:
            f = self._journals.get(model_id)
            if f is not None and f.tell() > JOURNAL_MAX:  # start afresh, atomically
                f.close()
                tmp = path.with_name(f".{path.name}.tmp")
                tmp.write_text(f"{next_seq}\n")
                os.replace(tmp, path)
                f = None
            if f is None:
                path.parent.mkdir(parents=True, exist_ok=True)
                f = self._journals[model_id] = path.open("a")
            f.write(f"{next_seq}\n")
            f.flush()

    def next_seq(self, rec: ModelRecord) -> int:
        """A persisted model's next seq_id: the newest of its record and its journal (a
        torn last line, from a kill mid-write, is skipped)."""
        path = _file(self.models_dir, rec.id).with_suffix(".seq")
        best = rec.next_seq
        if path.is_file():
            for line in path.read_text().splitlines():
                if line.strip().isdigit():
                    best = max(best, int(line))
        return best

    def close(self) -> None:
        with self._lock:
            for f in self._journals.values():
                f.close()
            self._journals.clear()

    def save_sampler(self, sid: str, base_model: str | None, model_path: str | None) -> None:
        self._write(_file(self.samplers_dir, sid),
                    {"id": sid, "base_model": base_model, "model_path": model_path})

    def _read(self, directory: Path) -> list[dict[str, Any]]:
        out = []
        for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
            try:
                value = json.loads(path.read_text())
                if not isinstance(value, dict):
                    raise ValueError("not an object")
                out.append(value)
            except (OSError, ValueError) as e:  # a torn or foreign file: skipped, said
                log.warning("unreadable tinker record skipped", path=str(path), error=str(e))
        return out

    def sessions(self) -> list[Session]:
        return [Session(**v) for v in self._records(self.sessions_dir, Session)]

    def models(self) -> list[ModelRecord]:
        return [ModelRecord(**v) for v in self._records(self.models_dir, ModelRecord)]

    def samplers(self) -> dict[str, dict[str, Any]]:
        return {str(v.get("id")): v for v in self._read(self.samplers_dir)}

    def _records(self, directory: Path, kind: type) -> list[dict[str, Any]]:
        names = {f.name for f in dataclasses.fields(kind)}
        out = []
        for value in self._read(directory):
            if not {f.name for f in dataclasses.fields(kind)
                    if f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING} <= set(value):
                log.warning("incomplete tinker record skipped", kind=kind.__name__,
                            record=str(value)[:200])
                continue
            out.append({k: v for k, v in value.items() if k in names})
        return out


def checkpoint_dir(root: Path, path: str, kind: str) -> Path:
    """The directory of a `tinker://RUN/KIND/NAME` path; UserError if it is none here."""
    m = TINKER_PATH.match(path)
    if m is None or m.group(2) != kind:
        raise UserError(f"{path!r} is not a tinker://RUN/{kind}/NAME path")
    out = root / "runs" / m.group(1) / kind / m.group(3)
    if not out.is_dir():
        raise UserError(f"no checkpoint {path!r} on this server")
    return out


def read_checkpoint(root: Path, path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(state, meta) of the newest intact checkpoint under a tinker://RUN/weights/NAME."""
    ckpt = load_latest(checkpoint_dir(root, path, "weights"))
    if ckpt is None:
        raise UserError(f"{path}: no intact checkpoint there (see the server's log)")
    return ckpt.state, ckpt.meta


def lost_message(rec: ModelRecord) -> str:
    """What a restart lost of a model that had trained past its last checkpoint."""
    if rec.origin is None:
        return (f"the server restarted after model {rec.id} had trained, and it was never "
                "saved (save_state): its training is lost. Create a new training client")
    return (f"the server restarted after model {rec.id} had trained past its last checkpoint "
            f"{rec.origin}: the training since is lost. Go on from that checkpoint with "
            f"ServiceClient.create_training_client_from_state_with_optimizer({rec.origin!r})")


def reload(entry: ModelEntry, root: Path, models_dir: Path, device: torch.device) -> None:
    """On the model thread: a restored model as its record says, its last checkpoint or
    as created (LoRA from its seed); `entry.error` says why not."""
    rec = entry.record
    assert rec is not None
    try:
        entry.base = resolve(entry.base_name, models_dir)
        trained = TrainedModel(entry.base, entry.lora, device)
        if rec.origin is not None:
            state, meta = read_checkpoint(root, rec.origin)
            trained.load_state(state, rec.origin_optimizer
                               and state.get("optimizer") is not None)
            trained.steps = int(meta.get("step", 0))
    except (UserError, CheckpointError) as e:
        entry.error = f"after a server restart: {e}"
        return
    entry.trained = trained
    log.info("model restored", model=entry.id, origin=rec.origin, lost=entry.lost is not None)
