"""A run whose agent fails every episode stops after run.max_failed_steps steps in a row,
with one error naming the cause and a checkpoint to resume from, in every strategy; a run
with some failed episodes goes on and counts them in summary.json."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from rlhf_async import job
from rlhf_async.config import load_config
from rlhf_async.metrics import read_metrics
from rlhf_async.rl.checkpoint import list_checkpoints
from rlhf_async.strategies.step_health import NothingTrained
from tests.text_model import text_job_files, text_job_overrides

pytestmark = [pytest.mark.timeout(300)]  # a hang guard: 129 s seen at load 19

AGENTS = {
    # never calls the endpoint
    "silent": '''
async def run(base_url, row):
    return 1.0
''',
    # calls it, then returns what is not a reward
    "wrong_type": '''
from openai import AsyncOpenAI


async def run(base_url, row):
    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        r = await client.completions.create(model="policy", prompt=row["prompt"])
    return r.choices[0].text
''',
    # hangs past task.agent_timeout_s
    "hangs": '''
import asyncio


async def run(base_url, row):
    await asyncio.sleep(3600)
''',
    # every request refused (400): it asks for another sampler than the run's
    "refused": '''
from openai import AsyncOpenAI


async def run(base_url, row):
    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        msgs = [{"role": "user", "content": row["prompt"]}]
        r = await client.chat.completions.create(model="policy", messages=msgs,
                                                 temperature=0.123)
    return 1.0
''',
    # fails on the "what ..." prompts only
    "some": '''
from openai import AsyncOpenAI


async def run(base_url, row):
    if row["prompt"].startswith("what"):
        raise KeyError("what")
    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        await client.completions.create(model="policy", prompt=row["prompt"], max_tokens=2)
    return 1.0
''',
}
# what the error names for each: the cause, and where (file:line) when the agent raised
CAUSES = {
    "silent": ("returned without calling the policy", None),
    "wrong_type": ("returned '", None),
    "hangs": ("did not return within task.agent_timeout_s = 0.5 s", None),
    "refused": ("raised BadRequestError", "r = await client.chat"),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = text_job_files(tmp_path_factory.mktemp("failing"), "unused.py", "")
    for name, code in AGENTS.items():
        (d / f"{name}.py").write_text(code)
    return d


def _cfg(files, tmp_path, name, agent, *overrides):
    return load_config(None, [
        *text_job_overrides(files, tmp_path, name),
        f"task.agent={json.dumps(str(files / f'{agent}.py') + ':run')}",
        "generation.max_episode_tokens=8", "run.eval_prompts=2", "train.steps=4",
        "train.prompts_per_step=2", "run.max_failed_steps=2", *overrides])


def _stopped(files, tmp_path, name, agent, *overrides):
    """Run the job; the NothingTrained it stops with, after checking what it left."""
    with pytest.raises(NothingTrained) as got:
        job.run(_cfg(files, tmp_path, name, agent, *overrides))
    run_dir = tmp_path / name
    records = read_metrics(run_dir / "metrics.jsonl")
    # stopped after two in a row (Separation's trainer may finish one more step first)
    assert [r["failed_steps"] for r in records] == list(range(1, len(records) + 1))
    assert len(records) == 2 or (name == "separation" and len(records) == 3)
    assert all(r["trained_samples"] == 0 and r["samples_per_s"] == 0 for r in records)
    kept = list_checkpoints(run_dir / "checkpoints")
    assert [c.name for c in kept] == [f"ckpt-{len(records):08d}"]
    assert not (run_dir / "policy").exists()
    message = str(got.value)
    assert "nothing trained in 2 steps in a row" in message
    assert "run.max_failed_steps = 2" in message
    assert f"`rlhf-async resume {run_dir}`" in message and f"checkpoint {kept[0].name}" in message
    return message


@pytest.mark.parametrize("agent", list(CAUSES))
def test_an_agent_failing_every_episode_stops_the_run_naming_why(files, tmp_path, agent):
    # (a short timeout only for the agent that hangs: the others call a loaded box's policy)
    message = _stopped(files, tmp_path, agent, agent,
                       *(["task.agent_timeout_s=0.5"] if agent == "hangs" else []))
    cause, line = CAUSES[agent]
    assert f"the first error: task.agent {files / agent}.py:run: run() " in message
    assert cause in message
    if line is not None:  # the agent raised: where, in its own file
        n = next(i for i, x in enumerate(AGENTS[agent].splitlines(), 1) if line in x)
        assert f"(at {files / agent}.py:{n})" in message
    kind = "0 failed, 8 timed out" if agent == "hangs" else "8 failed, 0 timed out"
    assert f"({kind}, 0 truncated, of 8)" in message


@pytest.mark.parametrize("strategy", ["interleaving", "separation"])
def test_every_strategy_stops_a_run_that_trains_nothing(files, tmp_path, strategy):
    more = ["placement.devices=2", "algo.max_staleness=0"] if strategy == "separation" \
        else ["placement.devices=2"]
    message = _stopped(files, tmp_path, strategy, "silent", f"placement.strategy={strategy}",
                       *more)
    assert "returned without calling the policy" in message


def test_a_run_with_some_failed_episodes_goes_on_and_counts_them(files, tmp_path):
    out = io.StringIO()
    summary = job.run(_cfg(files, tmp_path, "some", "some", "train.steps=2",
                           "train.prompts_per_step=4", "run.max_failed_steps=1"), out)
    records = read_metrics(tmp_path / "some" / "metrics.jsonl")
    assert len(records) == 2 and (tmp_path / "some" / "policy").exists()
    failed = int(sum(r["episodes/failed"] for r in records))
    assert 0 < failed < 16 and summary["episodes"] == 16
    assert summary["episodes_failed"] == failed
    assert summary["episodes_timeout"] == summary["failed_steps"] == 0
    assert summary["episodes_truncated"] == sum(r["episodes/truncated"] for r in records)
    # throughput counts what trained: a failed episode's row has nothing to train on
    trained = sum(r["trained_samples"] for r in records)
    assert trained == sum(r["samples"] for r in records) - failed
    assert summary["trained_samples"] == trained
    assert json.loads((tmp_path / "some" / "summary.json").read_text())["episodes_failed"] \
        == failed
    assert f"episodes failed {failed}, truncated" in out.getvalue()
    assert summary["reward_model"] is None  # the agent's reward, no reward model


def test_resume_after_the_agent_is_fixed_trains_from_the_checkpoint(files, tmp_path):
    agent = tmp_path / "agent.py"
    agent.write_text(AGENTS["silent"])
    cfg = _cfg(files, tmp_path, "fixed", "silent", "train.steps=3",
               f"task.agent={json.dumps(str(agent) + ':run')}")
    with pytest.raises(NothingTrained):
        job.run(cfg)
    agent.write_text(AGENTS["some"].replace('startswith("what")', 'startswith("?")'))
    # the user's fix above, then the command the error names
    # (a new process, as the user's: this one holds the agent it imported)
    resume = subprocess.run([sys.executable, "-m", "rlhf_async", "resume",
                             str(tmp_path / "fixed")], capture_output=True, text=True,
                            timeout=100)
    assert resume.returncode == 0, resume.stderr[-2000:]
    assert "2 steps trained on nothing" in resume.stdout
    records = read_metrics(tmp_path / "fixed" / "metrics.jsonl")
    assert [r["failed_steps"] for r in records] == [1, 2, 0]
    assert records[2]["trained_samples"] == 4 and records[2]["episodes/failed"] == 0
    summary = json.loads((tmp_path / "fixed" / "summary.json").read_text())
    assert summary["failed_steps"] == 2 and summary["trained_samples"] > 0
    assert (tmp_path / "fixed" / "policy").exists()
