"""Rank processes: one torch.distributed group per spawn, and a safe way out of it.

Flattening, Interleaving and the calibration probe run one spawned process per rank,
joined by a gloo (CPU) or NCCL (GPU) group. Such a process leaves through `exit_rank`,
not through the interpreter's normal exit, because of how a group can kill it there:

A gloo worker thread keeps the last collective it ran, tensors included, until its group
is destroyed, and dropping those tensors takes the GIL. A group still alive when the
interpreter exits is destroyed during finalization, where the GIL can no longer be taken;
the thread dies inside a destructor and the process aborts with "terminate called without
an active exception" (pytorch/pytorch#190489). `destroy_process_group` does not prevent
it when anything else still holds a group: DeepSpeed's engines, optimizers and ZeRO
parameters all hold its clone of the world group, and its hooks keep them alive. Two-rank
ZeRO-3 Flattening runs aborted that way, after finishing, in 7 of 84 runs.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from rlhf_async.config import ConfigError
from rlhf_async.wire.local import free_tcp_port as free_port  # the parent picks it

__all__ = ["Launch", "env_group", "exit_rank", "free_port", "join_group", "launched",
           "rank_group"]
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Launch:
    """This process as one rank of a job a launcher started (torchrun, srun + env)."""

    rank: int
    world: int
    local_rank: int


def launched() -> Launch | None:
    """The rank torchrun (or an srun script exporting the same variables) gave this
    process: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK (default 0); None when
    they are not all set. A malformed value is a ConfigError naming the variable."""
    env = os.environ
    if not all(env.get(k) for k in LAUNCH_ENV):
        return None
    values = {}
    for key, default in (("RANK", None), ("WORLD_SIZE", None), ("LOCAL_RANK", "0")):
        raw = env.get(key, default) or ""
        if not raw.isdigit():
            raise ConfigError([f"launcher environment: {key}={raw!r} is not a "
                               "non-negative integer"])
        values[key] = int(raw)
    if not values["RANK"] < values["WORLD_SIZE"]:
        raise ConfigError([f"launcher environment: RANK={values['RANK']} is not below "
                           f"WORLD_SIZE={values['WORLD_SIZE']}"])
    return Launch(values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"])


@contextlib.contextmanager
def env_group(backend: str, launch: Launch) -> Iterator[None]:
    """The launcher's rendezvous (env://: MASTER_ADDR, MASTER_PORT); NCCL on the GPU that
    LOCAL_RANK names; destroyed on the way out."""
    if backend == "nccl":
        torch.cuda.set_device(launch.local_rank)
    dist.init_process_group(backend, init_method="env://", rank=launch.rank,
                            world_size=launch.world)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def rank_group(backend: str, port: int, rank: int, world: int) -> Iterator[None]:
    """This process as `rank` of `world` in a group that rendezvouses on 127.0.0.1:`port`
    (NCCL: on GPU `rank` modulo the visible devices); destroyed on the way out."""
    if backend == "nccl":
        torch.cuda.set_device(rank % max(1, torch.cuda.device_count()))
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def join_group(backend: str, addr: str, port: int, rank: int, world: int, *,
               join_timeout_s: float, timeout: datetime.timedelta) -> None:
    """Make this process `rank` of `world` in the default group, meeting at addr:port
    (rank 0 hosts the store there). Every rank must arrive within `join_timeout_s`, else a
    TimeoutError names the group; each collective afterwards may wait up to `timeout`.
    For node processes that live in the group until they exit (see `exit_rank`)."""
    try:
        store = dist.TCPStore(addr, port, world, is_master=rank == 0, wait_for_workers=True,
                              timeout=datetime.timedelta(seconds=join_timeout_s))
    except (RuntimeError, dist.DistStoreError) as e:
        raise TimeoutError(f"rank {rank} of {world}: the group at {addr}:{port} did not "
                           f"form within {join_timeout_s:.0f}s: {e}") from None
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def exit_rank() -> NoReturn:
    """End a rank process that finished its work: flush what it wrote, then exit with
    status 0 without interpreter finalization (see the module docstring). Only for the
    success path: an exception should propagate so that the spawner reports it."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
