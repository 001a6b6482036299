"""Checkpoints: written atomically (temp dir, then rename), checksummed, newest good one wins.

A checkpoint is a directory `ckpt-00000012/` (the step to train next) holding `state.pt`
(tensors and optimizer states, loaded with `weights_only=True`: no arbitrary pickle runs),
`meta.json` (plain data: step, weight version, staleness bookkeeping, counts) and
`manifest.json` (sha256 and size of both files). A truncated or corrupted checkpoint fails
its checksum, is reported with a warning, and the previous one is used instead.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlhf_async.engines.lora import trainable_names
from rlhf_async.log import get_logger
from rlhf_async.rl.learner import Learner

log = get_logger(component="checkpoint")
PREFIX, MANIFEST, FORMAT = "ckpt-", "manifest.json", 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (missing files, bad checksum, wrong format)."""


class DiskFullError(CheckpointError):
    """A run's file could not be written: no space left (or the quota is used up)."""


def disk_full(e: BaseException, path: Path) -> DiskFullError | None:
    """One error naming what was written and the space left there, when `e` is a full disk
    or quota, or was raised while handling one (torch turns it into a RuntimeError on its
    way out); None for any other error."""
    if isinstance(e, DiskFullError):  # already says it (a checkpoint adds what is intact)
        return e
    cause = _full_disk_cause(e)
    if cause is None:
        return None
    what = "no space left on device" if cause.errno == errno.ENOSPC else "disk quota exceeded"
    return DiskFullError(f"{what} writing {cause.filename or path}: {_free(Path(path))} free "
                         "there")


def _full_disk_cause(e: BaseException | None) -> OSError | None:
    for _ in range(8):  # a short chain: the OSError, then what its handlers raised
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return e
        if e is None:
            return None
        e = e.__cause__ or e.__context__
    return None


def _free(path: Path) -> str:
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        free = float(shutil.disk_usage(path).free)
    except OSError:
        return "unknown space"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if free < 1024 or unit == "GiB":
            return f"{free:.0f} {unit}" if unit == "B" else f"{free:.1f} {unit}"
        free /= 1024
    raise AssertionError  # the loop returns at GiB


@dataclass
class Checkpoint:
    path: Path
    step: int  # the next step to train
    state: dict[str, Any]  # tensors / optimizer states
    meta: dict[str, Any]  # plain data


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(root: str | Path, step: int, state: dict[str, Any], meta: dict[str, Any],
                    keep: int = 3) -> Path:
    """Write checkpoint `step` under `root` atomically; keep the newest `keep`. A full disk
    is one DiskFullError; the checkpoints already there are left as they were."""
    root = Path(root)
    final = root / f"{PREFIX}{step:08d}"
    try:
        return _save(root, final, step, state, meta, keep)
    except (OSError, RuntimeError) as e:
        full = disk_full(e, final)
        if full is None:
            raise
        kept = list_checkpoints(root)
        intact = (f"the newest checkpoint, {kept[-1].name}, is intact" if kept else
                  "no checkpoint was written before")
        raise DiskFullError(f"{full}; {intact}: free some space, then continue with "
                            f"`rlhf-async resume {root.parent}`") from None


def _save(root: Path, final: Path, step: int, state: dict[str, Any], meta: dict[str, Any],
          keep: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{PREFIX}", dir=root))
    try:
        # through our own file: torch's writes then raise the OSError (ENOSPC), at most
        # wrapped in a RuntimeError; given a path it reports only "unexpected pos"
        with (tmp / "state.pt").open("wb") as f:
            torch.save(state, f)
        (tmp / "meta.json").write_text(json.dumps({**meta, "step": step}, indent=1))
        files = {n: {"sha256": _sha256(tmp / n), "bytes": (tmp / n).stat().st_size}
                 for n in ("state.pt", "meta.json")}
        (tmp / MANIFEST).write_text(json.dumps({"format": FORMAT, "step": step,
                                                "files": files}, indent=1))
        for name in (*files, MANIFEST):
            with (tmp / name).open("rb") as f:
                os.fsync(f.fileno())
        if final.exists():  # the same step written again (e.g. on stop right after a save)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    log.info("checkpoint_saved", step=step, path=str(final))
    return final


def list_checkpoints(root: str | Path) -> list[Path]:
    """Checkpoint directories under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)
                  and p.name[len(PREFIX):].isdigit())


def resume_hint(run_dir: str | Path) -> str:
    """What a run stopped by an error a rerun would repeat (the user's environment or reward
    server) keeps, and the command that goes on once it is fixed."""
    kept = list_checkpoints(Path(run_dir) / "checkpoints")
    where = (f"with its checkpoint {kept[-1].name}" if kept else
             "before its first checkpoint (resume starts at step 0)")
    return (f"the run stops {where}: fix it, then continue with "
            f"`rlhf-async resume {run_dir}`")


def verify(path: Path) -> dict[str, Any]:
    """The manifest of a complete, intact checkpoint; CheckpointError says what is wrong."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path.name}: unreadable manifest ({e})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path.name}: format {manifest.get('format')!r}, "
                              f"this build reads {FORMAT}")
    for name, want in manifest.get("files", {}).items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{path.name}: {name} is missing")
        if f.stat().st_size != want["bytes"]:
            raise CheckpointError(f"{path.name}: {name} has {f.stat().st_size} bytes, "
                                  f"manifest says {want['bytes']} (truncated?)")
        if _sha256(f) != want["sha256"]:
            raise CheckpointError(f"{path.name}: {name} fails its sha256 checksum")
    return manifest


def load_latest(root: str | Path, map_location: str | torch.device = "cpu") -> Checkpoint | None:
    """The newest checkpoint that passes its checksums; broken ones are skipped with a
    warning. None when there is none."""
    for path in reversed(list_checkpoints(root)):
        try:
            manifest = verify(path)
            state = torch.load(path / "state.pt", map_location=map_location,
                               weights_only=True)
            meta = json.loads((path / "meta.json").read_text())
        except (CheckpointError, OSError, RuntimeError, ValueError) as e:
            log.warning("checkpoint_skipped", path=str(path), error=str(e))
            continue
        return Checkpoint(path, int(manifest["step"]), state, meta)
    return None


def load_shared(root: str | Path, rank: int, world: int, device: str | torch.device,
                share: bool) -> Checkpoint | None:
    """`load_latest` for one rank of a group. With `share`, rank 0 reads it and hands it
    to the others (ranks on hosts that may not see `root`, or that must not pick a
    different "newest" than rank 0 did); else every rank reads it itself. Collective when
    sharing: every rank calls it."""
    if not share or world == 1:
        return load_latest(root, map_location=device)
    box: list[Checkpoint | None] = [load_latest(root) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def learner_state(learner: Learner) -> dict[str, Any]:
    """Everything that shapes the learner's next update: weights, optimizer moments, RNG.
    Full (gathered) weights whatever the training backend, but of a model with LoRA
    adapters only what trains (adapters, a critic's head): its base is the SFT model the
    run starts from anyway. Optimizer state as the backend gives it (a ZeRO optimizer's
    partitions, one per rank, under DeepSpeed)."""
    state: dict[str, Any] = {"version": learner.version, "kl_coef": learner.kl_coef,
                             "torch_rng": torch.get_rng_state(), "lora": _lora_key(learner),
                             "lr_schedule": _schedule_key(learner)}
    for name, backend in learner.backends().items():
        weights = backend.state_dict()
        if name in learner.adapted:
            trained = trainable_names(backend.module)
            weights = {k: v for k, v in weights.items() if k in trained}
        state[name] = weights
        state[f"{name}_opt"] = backend.optimizer_state_dict()
    return state


def _schedule_key(learner: Learner) -> dict[str, Any]:
    """What the learning rate of a step depends on besides the step (`learner.version`,
    saved too), so that a resume continues the schedule exactly."""
    t = learner.train
    return {"kind": t.lr_schedule, "warmup_steps": t.warmup_steps, "steps": t.steps,
            "lr": t.lr, "critic_lr": t.critic_lr}


def _lora_key(learner: Learner) -> dict[str, Any]:
    """What a checkpoint's weights depend on: which models have adapters, of what shape."""
    lora = learner.lora
    return {"adapted": sorted(learner.adapted), "rank": lora.rank, "alpha": lora.alpha,
            "target_modules": list(lora.target_modules)} if learner.adapted else {}


def restore_learner(learner: Learner, state: dict[str, Any]) -> None:
    saved_lora, lora = state.get("lora", {}), _lora_key(learner)  # older: no adapters
    if saved_lora != lora:
        raise CheckpointError(f"checkpoint was written with LoRA {saved_lora or 'off'}; this "
                              f"run has {lora or 'off'} (the lora.* keys must match)")
    for name, backend in learner.backends().items():
        if name not in state:
            raise CheckpointError(f"checkpoint has no {name}, but this run trains one "
                                  "(was it written by a critic-free algorithm?)")
        weights = state[name]
        if name in learner.adapted:  # the adapters over this run's own (SFT) base weights
            missing = sorted(trainable_names(backend.module) - weights.keys())
            if missing:
                raise CheckpointError(f"checkpoint's {name} lacks adapter weights "
                                      f"{missing[:3]}")
            weights = {**backend.state_dict(), **weights}
        try:
            backend.load_state_dict(weights)
        except RuntimeError as e:  # shapes or names: the model.* keys changed since
            first = str(e).strip().splitlines()
            raise CheckpointError(f"checkpoint's {name} does not fit this run's model (were "
                                  f"the model.* keys changed since it was written?): "
                                  f"{' '.join(x.strip() for x in first[:3])}") from None
        try:
            backend.load_optimizer_state_dict(state[f"{name}_opt"])
        except (KeyError, ValueError) as e:
            raise CheckpointError(f"checkpoint's {name} optimizer state does not fit this "
                                  f"run's train.backend={learner.train.backend}: {e}") from None
    learner.version = int(state["version"])
    saved = state.get("lr_schedule", _schedule_key(learner))  # older checkpoints: constant
    if saved != _schedule_key(learner):  # e.g. a longer run: the schedule is this run's
        log.warning("lr_schedule_changed_on_resume", saved=saved, now=_schedule_key(learner),
                    next_lrs=learner.lrs())
    learner.kl_coef = float(state.get("kl_coef", learner.algo.kl_coef))  # older checkpoints
    torch.set_rng_state(state["torch_rng"])
