"""Asking a running job to change shape, from another process: `rlhf-async scale RUN_DIR
generators=N scorers=M` and the daemon's `{"op": "scale", ...}` both come here, through
`strategies.registry.request_scale`, which passes the strategies' `scale_refusal`.

    scaled = await request_scale(run_dir, parse_scale(["generators=2"]), 300, refusal)

Refused with one `ReshapeError` (the job goes on unchanged): a run directory without a
running job, a job whose strategy does not scale (`refusal`, from each strategy's
`scalable` field: Flattening and Interleaving hold every model in one process per device,
there is no generator process to add), and whatever the running coordinator refuses
(counts below 1, too few free devices: control/reshape.py; on Ray, a cluster that cannot
hold the new bundles: strategies/separation/on_ray.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import psutil

from rlhf_async.control.client import (
    CommandError,
    CoordinatorError,
    call_coordinator,
    read_coordinator_file,
)
from rlhf_async.control.reshape import ReshapeError, Scale, Scaled
from rlhf_async.runtime.messages import MessageError, decode_reply, tag, to_payload

Refusal = Callable[[str], str | None]  # strategy name -> why it cannot scale, or None


def running_placement(run_dir: Path) -> dict:
    """The placement config of the job in `run_dir`; ReshapeError if there is none."""
    path = Path(run_dir) / "config.json"
    try:
        placement = json.loads(path.read_text())["placement"]
        str(placement["strategy"])
    except FileNotFoundError:
        raise ReshapeError(f"{run_dir} holds no job ({path} not found)") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ReshapeError(f"cannot read the job's placement from {path}: {e}") from None
    return dict(placement)


def check_scalable(run_dir: Path, refusal: Refusal) -> dict:
    """The running coordinator's file of the job in `run_dir` when its strategy scales
    (`refusal(strategy)` is None), or ReshapeError."""
    strategy = running_placement(run_dir)["strategy"]
    if (why := refusal(strategy)) is not None:
        raise ReshapeError(
            f"{run_dir} runs placement.strategy = {strategy!r}: {why}; to change its "
            "devices, stop it and resume it with another placement.devices")
    try:
        info = read_coordinator_file(run_dir)
    except CoordinatorError:
        raise ReshapeError(f"no running job in {run_dir} (no coordinator.json: it "
                           "finished, was stopped, or has not started its nodes yet)") from None
    pid = info.get("pid")
    if isinstance(pid, int) and not psutil.pid_exists(pid):
        raise ReshapeError(f"no running job in {run_dir} (stale coordinator.json: pid "
                           f"{pid} is gone)")
    return info


async def request_scale(run_dir: Path, scale: Scale, timeout: float,
                        refusal: Refusal) -> Scaled:
    """Ask the job in `run_dir` to scale; its new shape once the new processes are up and
    the retired ones gone (bounded by `timeout`). `refusal(strategy)`: why a job of that
    strategy cannot scale, None when it can (`strategies.registry.scale_refusal`: the
    strategies are above this layer)."""
    scale.targets()  # counts below 1, or nothing asked: refused before anything is sent
    info = check_scalable(run_dir, refusal)
    try:
        result = await call_coordinator(info["control"], tag(scale), to_payload(scale),
                                        timeout=timeout, keys=info.get("keys"))
    except TimeoutError:
        raise ReshapeError(f"the job in {run_dir} did not finish scaling in {timeout:.0f}s; "
                           "`rlhf-async status` shows its nodes now") from None
    except CommandError as e:
        # the coordinator's refusal, without the handler's exception type
        raise ReshapeError(str(e).split("ReshapeError: ", 1)[-1]) from None
    try:
        return decode_reply(scale, result)
    except MessageError as e:
        raise ReshapeError(f"the job in {run_dir} answered oddly: {e}") from None
