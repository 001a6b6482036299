"""A node's context (`nodes/common/context.py`): its task is built off the event loop."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import structlog

from nodes.common.context import load_context
from rlhf_async.config import load_config
from rlhf_async.config.schema import to_dict
from rlhf_async.runtime.process import _heartbeat_loop

pytestmark = [pytest.mark.timeout(60)]
TIME_TO_DEAD = 0.5  # a short runtime.time_to_dead: the longest silence the node may keep
IMPORT_S = 1.5  # the user's module takes this long to import (verifiers takes ~5 s)


class _Control:
    def __init__(self) -> None:
        self.beats: list[float] = []

    async def send(self, msg, timeout):
        self.beats.append(time.monotonic())


def test_a_slow_task_build_does_not_stop_the_heartbeats(tmp_path):
    agent = tmp_path / "slow_agent.py"
    agent.write_text(f"import time\ntime.sleep({IMPORT_S})\n\n\n"
                     "async def run(base_url, row):\n    return 0.0\n")
    cfg = load_config(None, ["task.name=calculator", f"task.agent={agent}:run"])
    control = _Control()
    spec = SimpleNamespace(orphan_timeout_s=60.0, heartbeat_s=0.05, device="cpu")
    node = SimpleNamespace(
        spec=spec, node_id="gen0", paused=False, _control=control, log=structlog.get_logger(),
        watchdog=SimpleNamespace(overdue=lambda: []), request_stop=lambda why: None,
        params={"config": to_dict(cfg), "sft_dir": str(tmp_path), "rm_dir": None})

    async def main():
        beating = asyncio.ensure_future(_heartbeat_loop(node, [time.monotonic()],
                                                        asyncio.Event()))
        t0 = time.monotonic()
        job = await load_context(node)
        took = time.monotonic() - t0
        beating.cancel()
        return job, took

    job, took = asyncio.run(main())
    assert took >= IMPORT_S and job.task.episode_spec().name == f"{agent}:run"
    gaps = [b - a for a, b in zip(control.beats, control.beats[1:], strict=False)]
    assert len(control.beats) > IMPORT_S / spec.heartbeat_s / 2
    assert max(gaps) < TIME_TO_DEAD
