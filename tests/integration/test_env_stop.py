"""A stop of a run whose episodes play an OpenEnv `module:app` the run serves itself, while
those episodes are in flight: reported as a stop (the step finished, a checkpoint, the
resume command, exit 0), never as the environment's failure, in every strategy.

The stop comes as a terminal's Ctrl-C or GNU `timeout` sends it: to the run's whole
process group (the test starts the run in a session of its own); for Separation also as
`rlhf-async stop`, the coordinator's stop."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.text_model import make_text_model

pytestmark = [pytest.mark.timeout(400)]

PROMPTS = ["guess a digit .", "name a digit .", "give one digit .", "what is the digit ?"]
STRATEGIES = {"flattening": ["placement.devices=1"],
              "interleaving": ["placement.devices=2"],
              "separation": ["placement.devices=2", "algo.max_staleness=0"]}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("env_stop") / "model", positions=256)


class _Run:
    """`rlhf-async run` in a session of its own, its output read as it comes."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "rlhf_async", "run", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, start_new_session=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def wait_for(self, ready, what: str, timeout: float = 240.0, exits: bool = False) -> None:
        """Until `ready()`; the run exiting first fails the test unless `exits`."""
        deadline = time.monotonic() + timeout
        while not ready():
            if exits and self.proc.poll() is not None:
                return
            assert self.proc.poll() is None, f"exited before {what}:\n{self.out[-3000:]}"
            assert time.monotonic() < deadline, f"no {what}:\n{self.out[-3000:]}"
            time.sleep(0.05)


def _steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.parametrize(("strategy", "how"), [
    ("flattening", "group"), ("interleaving", "group"), ("separation", "group"),
    ("separation", "stop")])
def test_a_stop_while_episodes_play_an_openenv_app_is_a_stop(model, tmp_path, strategy, how):
    pytest.importorskip("openenv")
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n"
                                              for p in PROMPTS * 2))
    hold = tmp_path / "hold"
    hold.mkdir()
    run_dir = tmp_path / "r"
    args = [f"model.path={json.dumps(str(model))}", "task.name=text",
            "generation.max_new_tokens=4", "train.steps=50", "train.prompts_per_step=4",
            "algo.group_size=2", "algo.name=grpo", "run.eval_prompts=4", "run.plot=false",
            "run.progress=false", "placement.cpu_threads=1",
            f"run.output_dir={json.dumps(str(tmp_path))}", "run.name=r",
            f"task.prompts={json.dumps(str(tmp_path / 'p.jsonl'))}",
            'task.env="openenv:tests.openenv_hold:app"', "task.max_turns=2",
            "generation.max_episode_tokens=24", 'generation.stop_strings=["."]',
            f"placement.strategy={strategy}", *STRATEGIES[strategy]]
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "RLHF_TEST_HOLD": str(hold),
           "PYTHONPATH": os.pathsep.join([str(repo), *filter(None, [os.environ.get(
               "PYTHONPATH")])])}
    run = _Run(args, env)
    try:
        run.wait_for(lambda: _steps(run_dir) >= 1, "a first step")
        (hold / "hold").touch()  # the episodes from now on wait in the environment's step
        run.wait_for((hold / "held").exists, "an episode in flight")
        if how == "group":
            os.killpg(run.proc.pid, signal.SIGTERM)
        else:
            stop = subprocess.run([sys.executable, "-m", "rlhf_async", "stop", "--run-dir",
                                   str(run_dir)], capture_output=True, text=True, timeout=120)
            assert stop.returncode == 0, stop.stdout + stop.stderr
        # the run has the stop (the console's line, or the JSON log's event), or is done
        # already (Separation's trainer stops without the chunk in flight)
        run.wait_for(lambda: re.search(r"stop.requested", run.out) is not None,
                     "the stop acknowledged", exits=True)
        (hold / "hold").unlink()  # the episodes in flight finish their step
        run.proc.wait(timeout=240)
    finally:
        if run.proc.poll() is None:
            os.killpg(run.proc.pid, signal.SIGKILL)
    run.reader.join(10)
    out = run.out
    assert run.proc.returncode == 0, out[-3000:]
    assert "raised" not in out and "ConnectionClosed" not in out, out[-3000:]
    ckpts = sorted((run_dir / "checkpoints").glob("ckpt-*"))
    assert ckpts, out[-3000:]
    step = int(ckpts[-1].name.split("-")[1])
    assert "stopped (" in out and f"checkpoint of step {step}" in out, out[-3000:]
    assert f"continue with: rlhf-async resume {run_dir}" in out
