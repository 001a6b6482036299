"""Adding an environment adapter is one class and one registry line: a toy adapter defined
here alone (`task.env = "toy:<count>"`: its rows the prompts, one held out; its environment
the episodes and their reward), registered by one `ADAPTERS` line, trains end to end
(`job.run`, tiny model, 2 steps, Flattening; and in the node processes of Separation and
the rank processes of Flattening on 2 devices, which take the line from the job's
process: it is in no module they import), and its own checks run before anything
starts (a bad argument: one clear error from `run --dry-run` and from `run`, nothing
written)."""

from __future__ import annotations

import json
from typing import Any, ClassVar

import pytest

from rlhf_async import job
from rlhf_async.cli import main
from rlhf_async.config import ConfigError, TaskConfig, load_config
from rlhf_async.metrics import read_metrics
from rlhf_async.task.adapters import ADAPTERS, Rows
from tests.text_model import make_text_model

pytestmark = [pytest.mark.timeout(300)]

THINGS = ["colour", "fruit", "animal", "apple", "pear", "cat", "dog", "sky"]


class ToyEnv:
    """One policy turn: reward 1 when the reply says 'yes'."""

    async def reset(self, row: dict[str, Any]) -> str:
        ToyAdapter.events.append("reset")
        return ""

    async def step(self, action: str) -> tuple[str, float, bool]:
        return "ok", float("yes" in action.split()), True


class ToyAdapter:
    key, gives_prompts, gives_reward, preload = "env", True, True, ()
    events: ClassVar[list[str]] = []  # what the job asked of it, in order

    def __init__(self, argument: str, task: TaskConfig) -> None:
        self.argument, self.task = argument, task

    def problems(self) -> list[str]:
        ToyAdapter.events.append("problems")
        ok = self.argument.isdigit() and 2 <= int(self.argument) <= len(THINGS)
        return [] if ok else [f"task.env: {self.task.env!r}: the toy adapter takes a count "
                              f"of prompts, 2..{len(THINGS)}"]

    def check_reachable(self) -> None:
        ToyAdapter.events.append("reachable")

    def rows(self) -> Rows:
        things = THINGS[: int(self.argument)]  # "toy:4": colour, fruit, animal, apple
        return Rows([f"name a {t} ." for t in things], [{"thing": t} for t in things],
                    [i == len(things) - 1 for i in range(len(things))])  # the last held out

    def rule(self) -> None:
        return None  # the episodes' rewards

    def environment(self) -> type[ToyEnv]:
        return ToyEnv

    def agent(self, tokenizer: Any) -> None:
        return None


@pytest.fixture
def toy(monkeypatch, tmp_path):
    monkeypatch.setitem(ADAPTERS, "toy", f"{__name__}:ToyAdapter")  # the one registry line
    monkeypatch.setattr(ToyAdapter, "events", [])
    model = make_text_model(tmp_path / "model")
    return [f"model.path={json.dumps(str(model))}", "task.name=text",
            "generation.max_new_tokens=4", "generation.max_episode_tokens=12",
            "task.max_turns=1", "train.steps=2", "train.prompts_per_step=2",
            "algo.group_size=2", "algo.name=grpo", "run.eval_prompts=2", "run.log_samples=4",
            "run.plot=false", "run.progress=false", "placement.strategy=flattening",
            f"run.output_dir={json.dumps(str(tmp_path / 'runs'))}"]


def test_a_toy_adapter_trains_on_its_prompts_and_episodes(toy, tmp_path):
    cfg = load_config(None, [*toy, "task.env=toy:4", "run.name=toy"])
    summary = job.run(cfg)
    run = tmp_path / "runs" / "toy"
    metrics = read_metrics(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1]
    # every one of a step's 4 rows an episode of its environment (one policy turn: done
    # there, or cut at the token limit first), its reward the environment's, 0 or 1
    for m in metrics:
        assert m["episodes/done"] + m["episodes/truncated"] == 4, m
        assert 0.0 <= m["hidden_score"] <= 1.0
    assert summary["final_hidden_score"] is not None
    trained = {s["prompt"].replace(" ", "") for line in (run / "samples.jsonl").read_text()
               .splitlines() for s in json.loads(line)["samples"]}
    # its training rows only (the held-out "apple" row is not trained on)
    assert trained and trained <= {f"namea{t}." for t in THINGS[:3]}, trained
    # its checks ran first, then (once, in this process) what it reaches, then episodes
    events = ToyAdapter.events
    assert events.index("problems") < events.index("reachable") < events.index("reset")
    assert events.count("reachable") == 1


@pytest.mark.parametrize("placement", [
    ["placement.strategy=separation"],
    ["placement.strategy=flattening", "placement.devices=2", "runtime.node_start=exec"]],
    ids=["separation-nodes", "flattening-2-exec-ranks"])
def test_the_registry_line_reaches_every_process_of_the_job(toy, tmp_path, placement):
    over = [o for o in toy if not o.startswith("placement.strategy")]
    cfg = load_config(None, [*over, *placement, "task.env=toy:4", "run.name=toy"])
    summary = job.run(cfg)
    metrics = read_metrics(tmp_path / "runs" / "toy" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1]
    assert all(m["episodes/done"] + m["episodes/truncated"] == 4 for m in metrics), metrics
    assert summary["final_hidden_score"] is not None


def test_a_bad_argument_is_one_error_before_anything_starts(toy, tmp_path, capsys):
    bad = [*toy, "task.env=toy:many", "run.name=bad"]
    assert main(["run", "--dry-run", *bad]) == 2
    out = capsys.readouterr()
    assert "task.env: 'toy:many': the toy adapter takes a count of prompts, 2..8" in \
        out.out + out.err and "Traceback" not in out.out + out.err
    with pytest.raises(ConfigError, match=r"the toy adapter takes a count of prompts"):
        job.run(load_config(None, bad))
    assert "reachable" not in ToyAdapter.events and "reset" not in ToyAdapter.events
    assert not (tmp_path / "runs" / "bad").exists()
    # a good one passes --dry-run, which asks what it reaches and plays no episode
    assert main(["run", "--dry-run", *toy, "task.env=toy:3", "run.name=good"]) == 0
    assert ToyAdapter.events[-1] == "reachable" and "reset" not in ToyAdapter.events
    assert not (tmp_path / "runs" / "good").exists()
