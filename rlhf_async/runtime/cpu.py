"""How a process computes on the CPU: its torch threads, and subnormal floats flushed to zero.

Subnormal (denormal) floats, below ~1.2e-38 in fp32, take a slow path on x86: every
multiply that reads or makes one costs tens of cycles instead of one. A policy's gradients
get that small as training goes on, and MKL's matmuls in the backward pass slowed ~1.7x in
a Separation trainer (bench/README.md, "Utilization"). Flushing them (the CPU's FTZ and DAZ
modes) reads and writes them as zero: the change to any sum of normal-sized terms is below
fp32's rounding.

The modes live in each thread's control register: a thread started later inherits them
from the thread that starts it, one already running keeps its own. So this runs first in
a process, before its worker threads exist.
"""

from __future__ import annotations

import torch


def set_cpu_compute(threads: int, flush_denormal: bool) -> None:
    """This process's torch threads, and whether it (and every thread it starts from here)
    flushes subnormal floats to zero; `flush_denormal=False` restores IEEE subnormals."""
    torch.set_num_threads(threads)
    torch.set_flush_denormal(flush_denormal)


def flushes_denormal() -> bool:
    """Whether the calling thread reads and writes subnormal floats as zero."""
    return torch.tensor([1e-39], dtype=torch.float32).mul(1.0).item() == 0.0
