"""A vLLM generator SIGKILLed with multi-turn episodes in flight (the calculator task under
Separation, `generation.backend = vllm`): the replacement serves again, every prompt is
trained exactly once, and nothing of the killed generator is left running (vLLM's engine
core is a process of its own, in the generator's session)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (tests/vllm need the vLLM venv)")

from rlhf_async.config import load_config
from rlhf_async.control.chaos import kill_nodes
from tests.faults import run_during, trained_counts

pytestmark = [pytest.mark.timeout(900)]

TINY = ["task.name=calculator", "model.hidden=128", "model.layers=1", "model.heads=2",
        "sft.steps=30", "run.eval_prompts=16", "train.prompts_per_step=8",
        "algo.group_size=2", "run.plot=false", "run.progress=false",
        "generation.backend=vllm"]


def _in_session(sid: int) -> list[int]:
    """Processes whose session is `sid` (a node runs in a session of its own)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.getsid(int(d.name)) == sid:
                    out.append(int(d.name))
            except (ProcessLookupError, PermissionError):
                continue
    return out


def test_a_killed_vllm_generator_with_episodes_in_flight_trains_every_prompt_once(
        tmp_path, cache) -> None:
    steps = 6
    cfg = load_config(None, [*TINY, f"run.cache_dir={json.dumps(str(cache))}",
                             f"run.output_dir={json.dumps(str(tmp_path))}", "run.name=kill",
                             f"train.steps={steps}", "placement.strategy=separation",
                             "placement.devices=3", "algo.max_staleness=1",
                             "run.checkpoint_every=1", "runtime.restart_limit=4",
                             "runtime.time_to_dead=5", "weight_sync.timeout_s=30"])
    victims: list = []
    run_during(cfg, lambda stop: kill_nodes(tmp_path / "kill", ["gen0"], 2, stop, victims))
    assert [v for v, _ in victims] == ["gen0"], victims
    counts = trained_counts(tmp_path / "kill")
    assert set(counts) == set(range(steps * 16)) and set(counts.values()) == {1}
    # the killed generator's processes (its first pid's session): none outlived it
    ready = [json.loads(line) for line in (tmp_path / "kill" / "logs" / "gen0.log")
             .read_text().splitlines() if '"node_ready"' in line]
    assert len(ready) == 2, "the killed generator and its replacement"
    assert _in_session(ready[0]["pid"]) == []
