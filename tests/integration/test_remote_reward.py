"""The built-in task's rule served by `rlhf-async serve-reward` (a real process on
127.0.0.1) gives the same trajectory as the rule in process, under Flattening and under
Separation (its scorer asks the server); a server that fails mid-run stops the run with the
URL and its answer, and the trainer's checkpoint."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from aiohttp import web

from rlhf_async import job
from rlhf_async.cli.main import main as cli_main
from rlhf_async.config import config_from_dict, load_config
from rlhf_async.metrics import read_metrics
from rlhf_async.rl.checkpoint import PREFIX
from rlhf_async.strategies.base import UserCodeFailed
from rlhf_async.strategies.separation.startup import PipelineError
from rlhf_async.task.rewards.remote_reward import RewardServerError
from rlhf_async.task.sort_digits import rule
from tests.served import serving

pytestmark = [pytest.mark.timeout(300)]
REPO = Path(__file__).resolve().parents[2]
# the rule feeds the reward (reward model + 1.0 x rule), so the served one steers training
TINY = ["model.hidden=32", "model.layers=1", "model.heads=2", "sft.steps=30",
        "reward_model.steps=30", "reward_model.heldout_pairs=64", "run.eval_prompts=16",
        "train.steps=3", "train.prompts_per_step=8", "algo.group_size=2", "run.plot=false",
        "run.progress=false", "task.reward_weight=1.0", "algo.name=grpo"]
KEYS = ["policy_loss", "reward", "hidden_score", "kl", "entropy", "response_length"]


@pytest.fixture(scope="module")
def served():
    """`rlhf-async serve-reward rlhf_async.task.sort_digits:rule --port 0`: its URL."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "rlhf_async", "serve-reward",
                             "rlhf_async.task.sort_digits:rule", "--port", "0"],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()  # printed once it listens
        url = re.search(r"at (http://\S+) ", line)
        assert url, line
        yield url.group(1)
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) in (0, 130)  # Ctrl-C / SIGTERM: a clean stop


def _run(tmp_path, cache, name, *overrides):
    cfg = load_config(None, [*TINY, f"run.cache_dir={json.dumps(str(cache))}",
                             f"run.output_dir={json.dumps(str(tmp_path))}", f"run.name={name}",
                             *overrides])
    summary = job.run(cfg)
    return summary, read_metrics(tmp_path / name / "metrics.jsonl")


def test_the_server_answers_what_the_function_does(served):
    body = json.dumps({"prompts": ["12", "31"], "responses": ["12$", "31$"]}).encode()
    req = urllib.request.Request(served, body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert json.loads(resp.read()) == {"rewards": [rule("12", "12$"), rule("31", "31$")]}
    bad = urllib.request.Request(served, b'{"prompts": ["1"]}')
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(bad, timeout=30)
    assert e.value.code == 400 and json.loads(e.value.read()) == {
        "error": 'bad request: "responses" must be a list of strings, got nothing'}


def test_served_rule_gives_the_in_process_trajectory(tmp_path, cache, served, one_thread):
    base, flat = _run(tmp_path, cache, "in_process")
    url = f"task.reward={json.dumps(served)}"
    remote, flat_served = _run(tmp_path, cache, "served", url, "task.reward_request_rows=5")
    assert len(flat) == len(flat_served) == 3
    for a, b in zip(flat, flat_served, strict=True):
        assert {k: a[k] for k in KEYS} == {k: b[k] for k in KEYS}
    assert base["final_hidden_score"] == remote["final_hidden_score"]
    _, sep = _run(tmp_path, cache, "sep", url, "placement.strategy=separation",
                  "placement.devices=2", "algo.max_staleness=0")
    for a, b in zip(flat, sep, strict=True):
        for k in KEYS:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-5), (a["step"], k)


def test_a_server_failing_mid_run_stops_separation_with_a_checkpoint(tmp_path, cache):
    # from step 1 on (the trainer has trained step 0) the scorer node's requests fail
    with serving(_flaky_app(tmp_path / "flaky" / "metrics.jsonl", 1, [True])) as url, \
            pytest.raises(PipelineError) as e:
        _run(tmp_path, cache, "flaky", f"task.reward={json.dumps(url)}",
             "placement.strategy=separation", "placement.devices=2", "algo.max_staleness=0",
             "train.steps=4", "task.reward_retries=1", "task.reward_backoff_s=0.01")
    assert str(e.value) == (f"scorer0: task.reward: reward server {url} answered 503 Service "
                            "Unavailable: '{\"error\": \"judge model unloaded\"}' (the last "
                            "of 2 tries; task.reward_retries = 1) (the run stops, its newest "
                            "checkpoint kept: once fixed, continue with `rlhf-async resume "
                            f"{tmp_path / 'flaky'}`)")
    done = [int(p.name[len(PREFIX):]) for p in (tmp_path / "flaky" / "checkpoints").iterdir()
            if p.name.startswith(PREFIX)]
    assert done and max(done) >= 1, done  # the trainer stopped with what it had trained


def _flaky_app(metrics: Path, steps_first: int, down: list[bool]) -> web.Application:
    """The built-in rule, answering 503 once `steps_first` steps are in `metrics` while
    `down[0]` holds."""
    async def flaky(request: web.Request) -> web.Response:
        body = await request.json()
        done = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        if down[0] and done >= steps_first:
            return web.json_response({"error": "judge model unloaded"}, status=503)
        return web.json_response({"rewards": [rule(p, r) for p, r in
                                              zip(body["prompts"], body["responses"],
                                                  strict=True)]})
    app = web.Application()
    app.router.add_post("/reward", flaky)
    return app


def test_lock_step_keeps_what_it_trained_and_resumes_once_the_server_answers(tmp_path,
                                                                             cache):
    run_dir, down = tmp_path / "flat", [True]
    with serving(_flaky_app(run_dir / "metrics.jsonl", 2, down)) as url:
        with pytest.raises(UserCodeFailed) as e:
            _run(tmp_path, cache, "flat", f"task.reward={json.dumps(url)}",
                 "task.reward_retries=1", "task.reward_backoff_s=0.01")
        assert str(e.value) == (f"task.reward: reward server {url} answered 503 Service "
                                "Unavailable: '{\"error\": \"judge model unloaded\"}' (the "
                                "last of 2 tries; task.reward_retries = 1); the run stops with "
                                f"its checkpoint {PREFIX}00000002: fix it, then continue with "
                                f"`rlhf-async resume {run_dir}`")
        assert isinstance(e.value.__cause__, RewardServerError)
        assert [p.name for p in (run_dir / "checkpoints").iterdir()
                if p.name.startswith(PREFIX)] == [f"{PREFIX}{2:08d}"]
        down[0] = False  # back: the run goes on from step 2
        job.run(config_from_dict(json.loads((run_dir / "config.json").read_text())),
                run_dir=run_dir)
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [0, 1, 2]


def test_a_server_that_is_down_is_one_error_from_the_cli(tmp_path, cache, capsys):
    with socket.socket() as s:  # bound, not listening: connections are refused
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/reward"
        rc = cli_main(["run", *TINY, f"run.cache_dir={json.dumps(str(cache))}",
                       f"run.output_dir={json.dumps(str(tmp_path))}", "run.name=down",
                       f"task.reward={json.dumps(url)}", "task.reward_backoff_s=0.01"])
    err = capsys.readouterr().err
    assert rc != 0 and "Traceback" not in err
    assert err == (f"rlhf-async run: error: task.reward: reward server {url} could not be "
                   "reached (Connection refused) (the last of 3 tries; task.reward_retries = "
                   "2)\n"), err
