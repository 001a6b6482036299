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
import logging
import os
import sys
from collections.abc import Iterator
from typing import NoReturn

import torch
import torch.distributed as dist

from rlhf_async.wire.transport import free_tcp_port as free_port  # the parent picks it

__all__ = ["exit_rank", "free_port", "rank_group"]


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


def exit_rank() -> NoReturn:
    """End a rank process that finished its work: flush what it wrote, then exit with
    status 0 without interpreter finalization (see the module docstring). Only for the
    success path: an exception should propagate so that the spawner reports it."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
