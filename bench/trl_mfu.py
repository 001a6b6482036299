"""MFU computed the same way for TRL's rows and ours (`bench.trl_compare`): each side's model
FLOPs per step from the same token counts (modeling/flops.py) over its steady wall time and
the machine's fp32 matmul peak, the best of the bench's measurements of it."""

from __future__ import annotations

from typing import Any

import torch

from rlhf_async.modeling.flops import Utilization, measure_peak, shape_of_dir, train_flops


def machine_peak(cores: int) -> float:
    """The fp32 matmul peak of `cores` one-thread slots (ours runs one per core; TRL's
    threads use the same cores): the MFU denominator of both sides."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return cores * measure_peak(torch.float32, seconds=1.0)
    finally:
        torch.set_num_threads(threads)


def rescale_mfu(rows: dict[str, dict], measured: float, peak: float) -> None:
    """Rows' `mfu_step`, divided by the peak `measured` before them, rescaled in place to
    `peak`, the best measured: load only slows a matmul, and a low peak flatters MFU."""
    for r in rows.values():
        if "mfu_step" in r:
            r["mfu_step"] *= measured / peak


def step_mfu(art: Any, records: list[dict[str, float]], passes: float | None, wall: float,
             peak: float) -> float:
    """Model FLOPs of the steps of `records` (token counts; ours carry `flops/train`, else
    `passes` over the actor) over `wall` seconds of the whole machine's `peak`: ours and
    TRL's computed the same way (modeling/flops.py)."""
    actor = shape_of_dir(art.sft_dir, lm=True)
    u = Utilization(actor, shape_of_dir(art.rm_dir, lm=False), actor, None, peak, 1)
    total = 0.0
    for r in records:
        f = u.flops({**r, "flops/train": r.get("flops/train") or
                     train_flops(actor, None, passes or 0.0, r)})
        total += sum(f.values())
    return total / (wall * peak)
