"""A node's context (`nodes/common/context.py`): its task is built off the event loop."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import structlog

from nodes.common.context import load_context
from rlhf_async.config import load_config
from rlhf_async.config.schema import to_dict
from rlhf_async.runtime.process import _heartbeat_loop

pytestmark = [pytest.mark.timeout(120)]
BEATS = 3  # heartbeats the test waits for while the user's module is still importing
GATE_S = 60.0  # how long the module waits for them before giving up (a loop it blocked)


class _Control:
    """Counts the node's heartbeats; after BEATS of them, lets the user's import finish."""

    def __init__(self, gate: threading.Event) -> None:
        self.beats = 0
        self.gate = gate

    async def send(self, msg, timeout):
        self.beats += 1
        if self.beats >= BEATS:
            self.gate.set()


def test_a_slow_task_build_does_not_stop_the_heartbeats(tmp_path, monkeypatch):
    """The user's module (verifiers takes ~5 s to import) finishes importing only after the
    node has sent BEATS heartbeats: were the task built on the event loop, no heartbeat could
    be sent and the import would give up after GATE_S. No verdict rests on how fast this CPU
    is: the import waits on the beats themselves."""
    gate = threading.Event()
    monkeypatch.setitem(sys.modules, "_test_heartbeat_gate", SimpleNamespace(gate=gate))
    agent = tmp_path / "slow_agent.py"
    agent.write_text("import _test_heartbeat_gate as g\n"
                     f"RELEASED_BY_BEATS = g.gate.wait({GATE_S})\n\n\n"
                     "async def run(base_url, row):\n    return 0.0\n")
    cfg = load_config(None, ["task.name=calculator", f"task.agent={agent}:run"])
    control = _Control(gate)
    spec = SimpleNamespace(orphan_timeout_s=GATE_S * 2, heartbeat_s=0.05, device="cpu")
    node = SimpleNamespace(
        spec=spec, node_id="gen0", paused=False, _control=control, log=structlog.get_logger(),
        watchdog=SimpleNamespace(overdue=lambda: []), request_stop=lambda why: None,
        params={"config": to_dict(cfg), "sft_dir": str(tmp_path), "rm_dir": None})

    async def main():
        beating = asyncio.ensure_future(_heartbeat_loop(node, [time.monotonic()],
                                                        asyncio.Event()))
        job = await load_context(node)
        beating.cancel()
        return job

    job = asyncio.run(main())
    assert job.task.episode_spec().name == f"{agent}:run"
    assert gate.is_set() and control.beats >= BEATS
    loaded = [m for m in sys.modules.values()
              if getattr(m, "__file__", None) == str(agent)]
    assert loaded and loaded[0].RELEASED_BY_BEATS, "the import gave up: no heartbeat came"
