"""The standards' environments and datasets trained as they are, end to end (`job.run`,
tiny model, 2 steps), under Flattening and Separation: a reasoning-gym dataset scored by
its own scorer, an OpenEnv environment served for real, a verifiers environment."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rlhf_async import job
from rlhf_async.config import load_config
from rlhf_async.metrics import read_metrics
from tests.example_commands import readme_command
from tests.text_model import make_text_model

pytestmark = [pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("adapters") / "model", positions=256)


def _run(model, tmp_path, name, *overrides):
    cfg = load_config(None, [
        f"model.path={json.dumps(str(model))}", "task.name=text", "generation.max_new_tokens=4",
        "train.steps=2", "train.prompts_per_step=4", "algo.group_size=2", "algo.name=grpo",
        "run.eval_prompts=4", "run.plot=false", "run.progress=false",
        f"run.output_dir={json.dumps(str(tmp_path))}", f"run.name={name}", *overrides])
    summary = job.run(cfg)
    return summary, read_metrics(tmp_path / name / "metrics.jsonl")


@pytest.mark.parametrize("strategy", ["flattening", "separation"])
def test_a_reasoning_gym_dataset_trains_with_its_scorer(model, tmp_path, strategy):
    pytest.importorskip("reasoning_gym")
    more = ["placement.devices=2", "algo.max_staleness=0"] if strategy == "separation" else []
    summary, metrics = _run(model, tmp_path, strategy,
                            "task.prompts=reasoning_gym:basic_arithmetic",
                            "task.reasoning_gym={size = 32, seed = 1}",
                            f"placement.strategy={strategy}", *more)
    assert [m["step"] for m in metrics] == [0, 1]
    assert all(0.0 <= m["hidden_score"] <= 1.0 for m in metrics)
    assert summary["final_hidden_score"] is not None


GUESS_APP = "examples.openenv_guess.server:app"
PROMPTS = ["guess a digit .", "name a digit .", "give one digit .", "what is the digit ?"]


@pytest.fixture(scope="module")
def guess_server():
    """The example OpenEnv server, served for real by uvicorn (not a fake)."""
    pytest.importorskip("openenv")
    from rlhf_async.task.adapters.openenv import _LocalServer

    server = _LocalServer(GUESS_APP)
    yield server.url
    server.stop()


@pytest.mark.parametrize("strategy", ["flattening", "separation"])
def test_an_openenv_environment_trains(model, tmp_path, strategy, guess_server):
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n"
                                              for p in PROMPTS * 2))
    # Flattening starts its own server from the module path; Separation reaches the
    # fixture's at its URL
    env = GUESS_APP if strategy == "flattening" else guess_server
    more = ["placement.devices=2", "algo.max_staleness=0"] if strategy == "separation" else []
    _, metrics = _run(model, tmp_path, strategy,
                            f"task.prompts={json.dumps(str(tmp_path / 'p.jsonl'))}",
                            f"task.env={json.dumps('openenv:' + env)}", "task.max_turns=2",
                            "generation.max_episode_tokens=24", "generation.stop_strings=[\".\"]",
                            f"placement.strategy={strategy}", *more)
    assert [m["step"] for m in metrics] == [0, 1]
    for m in metrics:  # every episode ended one of the counted ways, all 8 of the step
        assert sum(m[f"episodes/{k}"] for k in ("done", "max_turns", "truncated",
                                                 "timeout")) == 8
        assert m["episodes/timeout"] == 0 and 0.0 <= m["hidden_score"] <= 1.0


OPENENV_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "openenv_guess"
# the README's command on the tiny model, sized to a test (one step, few episodes)
SMALL = {"model.path", "train.steps", "train.prompts_per_step", "algo.group_size",
         "run.eval_samples", "run.eval_prompts"}


def test_the_openenv_examples_command_runs(model, tmp_path, monkeypatch):
    """The command examples/openenv_guess/README.md shows, as a user runs it from the
    repository root (its prompts file, its server started by the run), on the tiny model:
    every episode plays the game (reset, then the server's answers) to one of its ends."""
    pytest.importorskip("openenv")
    monkeypatch.chdir(OPENENV_EXAMPLE.parents[1])
    args = [a for a in readme_command(OPENENV_EXAMPLE / "README.md")
            if a.partition("=")[0] not in SMALL]
    summary, metrics = _run(model, tmp_path, "example", *args, "train.steps=1",
                            "train.prompts_per_step=2", "algo.group_size=2",
                            "run.eval_prompts=2", "run.eval_samples=1")
    assert [m["step"] for m in metrics] == [0]
    m = metrics[0]
    assert sum(m[f"episodes/{k}"] for k in ("done", "max_turns", "truncated")) == 4
    assert m["episodes/timeout"] == m["episodes/failed"] == 0
    assert summary["sft_hidden_score"] is not None and summary["final_hidden_score"] is not None
    logged = [s for x in (tmp_path / "example" / "samples.jsonl").read_text().splitlines()
              for s in json.loads(x)["samples"]]
    # the server's opening answers each prompt before the policy's first turn
    assert logged and all([t["role"] for t in s["turns"][:3]] ==
                          ["prompt", "environment", "policy"] for s in logged)


VF_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "verifiers_env"


@pytest.mark.parametrize("strategy", ["flattening", "separation"])
def test_a_verifiers_environment_trains(model, tmp_path, strategy, monkeypatch):
    """The example verifiers environment (built with the verifiers package): its harness
    calls the policy's endpoint, its rubric is the reward."""
    pytest.importorskip("verifiers")
    pytest.importorskip("rlhf_async.task.agents.agent")  # the endpoint its harness calls
    monkeypatch.syspath_prepend(str(VF_EXAMPLE))  # node processes: the fork server's path
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(VF_EXAMPLE), *filter(None, [os.environ.get("PYTHONPATH")])]))
    more = ["placement.devices=2", "algo.max_staleness=0"] if strategy == "separation" else []
    _, metrics = _run(model, tmp_path, strategy, "task.env=verifiers:vf_repeat",
                      'task.verifiers={taskset = {words = ["apple", "pear", "cat", "dog", '
                      '"sky", "sea", "red", "blue", "green"]}}', "task.max_turns=1",
                      "generation.max_episode_tokens=24", f"placement.strategy={strategy}",
                      *more)
    assert [m["step"] for m in metrics] == [0, 1]
    for m in metrics:  # every episode played through to the rubric's score
        assert m["episodes/done"] + m["episodes/truncated"] == 8
        assert m["episodes/failed"] == 0 and 0.0 <= m["hidden_score"] <= 1.0
