"""A job a launcher started: torchrun (or srun exporting RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, LOCAL_RANK) runs `rlhf-async run` once per rank, on one host or many.

Rank 0 is the job as on one machine: it holds the run directory, trains (or reuses) the SFT
policy and the reward model, evaluates, writes every file. It then hands the other ranks
what they need to start RL - the artefacts' files (so their hosts need no shared
filesystem and no training of their own, and every rank starts from the same bits) and the
step to start from - and all ranks run the lock-step loop together in the launcher's
process group. If rank 0 stops before that point (a held directory, a finished run, a bad
prompts file), the others are told why and exit with it instead of waiting.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import torch.distributed as dist

from rlhf_async.config import ConfigError, JobConfig
from rlhf_async.engines.process_group import Launch
from rlhf_async.strategies.base import RankFailed
from rlhf_async.task.artefacts import Artefacts, atomic_dir

Share = Callable[[Artefacts, int, Path], None]  # (artefacts, start step, run dir) -> all ranks


def adopt_world(cfg: JobConfig, launch: Launch) -> JobConfig:
    """`placement.devices` is the launcher's WORLD_SIZE (left at 1, it is set to it)."""
    p = cfg.placement
    if p.devices not in (1, launch.world):
        raise ConfigError([f"placement.devices: {p.devices}, but the launcher started "
                           f"WORLD_SIZE={launch.world} ranks; leave it unset or make them "
                           "equal"])
    return dataclasses.replace(cfg, placement=dataclasses.replace(p, devices=launch.world))


def lock_step_only(strategy: str, lock_step: bool) -> None:
    if not lock_step:
        raise ConfigError([f"placement.strategy: {strategy} starts its own node processes; "
                           "under a launcher (torchrun, srun) run flattening or "
                           "interleaving, or start it with `rlhf-async run` on one machine "
                           "(deploy/launch.sh for several)"])


@contextlib.contextmanager
def leading() -> Iterator[Share]:
    """Rank 0's side: `share(art, start_step, run_dir)` once the artefacts are ready.
    Leaving without sharing (an error, or nothing to do) tells the other ranks so."""
    shared = False

    def share(art: Artefacts, start_step: int, run_dir: Path) -> None:
        nonlocal shared
        _broadcast({"art": _pack(art), "start_step": start_step, "run_dir": str(run_dir)})
        shared = True
    try:
        yield share
    except BaseException as e:
        if not shared:
            _broadcast({"error": f"{type(e).__name__}: {e}".strip()})
        raise
    if not shared:
        _broadcast({"done": True})


def follow() -> tuple[Artefacts, int, Path] | None:
    """Another rank's side: rank 0's artefacts (written here if missing), start step and run
    directory (rank 0's name for it; only rank 0 writes there); None when rank 0 has
    nothing to run; RankFailed with rank 0's reason when it failed."""
    msg = _broadcast(None)
    if "error" in msg:
        raise RankFailed(f"rank 0 stopped the job before RL: {msg['error']}")
    if "done" in msg:
        return None
    return _unpack(msg["art"]), int(msg["start_step"]), Path(msg["run_dir"])


def _broadcast(obj: object) -> dict:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    assert isinstance(box[0], dict)
    return box[0]


def _files(d: Path | None) -> dict[str, bytes] | None:
    """A directory's files (artefacts rank 0 trained); None for a model directory the
    user gave (model.path), which every host must hold itself."""
    if d is None or not (d / "stats.json").exists():
        return None
    return {str(f.relative_to(d)): f.read_bytes() for f in sorted(d.rglob("*")) if f.is_file()}


def _pack(art: Artefacts) -> dict:
    return {"sft_dir": str(art.sft_dir), "sft": _files(art.sft_dir),
            "rm_dir": None if art.rm_dir is None else str(art.rm_dir), "rm": _files(art.rm_dir),
            "sft_stats": art.sft_stats, "rm_stats": art.rm_stats}


def _unpack(msg: dict) -> Artefacts:
    for key in ("sft", "rm"):
        if msg[key] is not None:
            _write_dir(Path(msg[f"{key}_dir"]), msg[key])
    return Artefacts(Path(msg["sft_dir"]), None if msg["rm_dir"] is None else
                     Path(msg["rm_dir"]), msg["sft_stats"], msg["rm_stats"])


def _write_dir(final: Path, files: dict[str, bytes]) -> None:
    """Rank 0's artefact directory, here (all or nothing; kept when it is already here,
    e.g. on rank 0's own host or a shared filesystem)."""
    if (final / "stats.json").exists():
        return

    def write(tmp: Path) -> None:
        for name, data in files.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_bytes(data)
    atomic_dir(final, write)
