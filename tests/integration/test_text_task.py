"""The text task end to end (`job.run`) on a tiny tokenizer + GPT-2: the trained rewards are
the user's rule on decoded responses, under Flattening (GRPO and PPO with a critic built
from the policy's trunk), Interleaving, and Separation (the rule runs in the scorer node; the
generator node ends responses at a stop string)."""

from __future__ import annotations

import json
import os

import pytest

from rlhf_async import job
from rlhf_async.config import load_config
from rlhf_async.metrics import read_metrics
from rlhf_async.strategies.separation.startup import PipelineError
from rlhf_async.task.text import heldout_split
from tests.text_model import make_text_model

pytestmark = [pytest.mark.timeout(300)]

PROMPTS = ["name a fruit .", "name a colour .", "list three animal .", "what is the sky ?",
           "give one fruit .", "name a big animal .", "what colour is the sea ?",
           "name a small animal .", "list three colour .", "is the sky blue ?"]
TRAIN = {PROMPTS[i] for i in heldout_split(PROMPTS)[0]}
REWARD = '''
import json, os

def logged(prompt, response):
    r = len(response.split()) / 5
    with open(os.environ["TEXT_REWARD_LOG"], "a") as f:
        f.write(json.dumps({"prompt": prompt, "response": response, "r": r}) + "\\n")
    return r
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("text")
    (d / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    (d / "reward.py").write_text(REWARD)
    make_text_model(d / "model")
    return d


def _run(files, tmp_path, monkeypatch, name, *overrides):
    log = tmp_path / f"{name}.rewards.jsonl"
    monkeypatch.setenv("TEXT_REWARD_LOG", str(log))
    cfg = load_config(None, [
        f"model.path={json.dumps(str(files / 'model'))}", "task.name=text",
        f"task.prompts={json.dumps(str(files / 'prompts.jsonl'))}",
        f"task.reward={json.dumps(str(files / 'reward.py') + ':logged')}",
        "generation.max_new_tokens=6", "task.max_prompt_tokens=32", "train.steps=3",
        "train.prompts_per_step=4",
        "algo.group_size=2", "algo.name=grpo", "run.eval_prompts=16", "run.plot=false",
        "run.progress=false", f"run.output_dir={json.dumps(str(tmp_path))}",
        f"run.name={name}", *overrides])
    summary = job.run(cfg)
    calls = [json.loads(x) for x in log.read_text().splitlines()]
    return summary, read_metrics(tmp_path / name / "metrics.jsonl"), calls


def _check_rule_rewards(metrics, calls, per_step):
    train = [c for c in calls if c["prompt"] in TRAIN]  # eval prompts are held out
    assert len(metrics) == 3 and len(train) == 3 * per_step
    for m in metrics:
        assert m["reward"] == pytest.approx(m["hidden_score"], abs=1e-6)
    overall = sum(c["r"] for c in train) / len(train)
    assert sum(m["reward"] for m in metrics) / 3 == pytest.approx(overall, abs=1e-5)
    assert all(c["r"] == len(c["response"].split()) / 5 for c in calls)


def test_flattening_trains_on_the_rule_reward(files, tmp_path, monkeypatch):
    summary, metrics, calls = _run(files, tmp_path, monkeypatch, "flat")
    _check_rule_rewards(metrics, calls, per_step=8)
    held = len(PROMPTS) - len(TRAIN)
    assert [c["prompt"] in TRAIN for c in calls] == [False] * held + [True] * 24 + [False] * held
    for s, m in enumerate(metrics):  # one process: the calls come in step order
        step = calls[held + 8 * s: held + 8 * (s + 1)]
        assert m["reward"] == pytest.approx(sum(c["r"] for c in step) / 8, abs=1e-6)
    assert summary["rm_accuracy"] is None and summary["eval_prompts"] == held
    assert summary["pretrain_seconds"] < 5  # no SFT, no reward model


def test_ppo_critic_from_the_policy_trunk(files, tmp_path, monkeypatch):
    _, metrics, calls = _run(files, tmp_path, monkeypatch, "ppo", "algo.name=ppo")
    _check_rule_rewards(metrics, calls, per_step=8)
    assert all(m["value_loss"] > 0 for m in metrics)


def test_interleaving_trains_on_the_rule_reward(files, tmp_path, monkeypatch):
    _, metrics, calls = _run(files, tmp_path, monkeypatch, "inter",
                             "placement.strategy=interleaving", "placement.devices=2")
    _check_rule_rewards(metrics, calls, per_step=8)


def test_separation_scores_with_the_rule_in_the_scorer(files, tmp_path, monkeypatch):
    _, metrics, calls = _run(files, tmp_path, monkeypatch, "sep",
                             "placement.strategy=separation", "placement.devices=2",
                             'generation.stop_strings=["sky"]')
    _check_rule_rewards(metrics, calls, per_step=8)
    # the generator node ends a response at its stop string (the string kept in it)
    assert all(c["response"].find("sky") in (-1, len(c["response"]) - 3) for c in calls)
    assert any(c["response"].endswith("sky") and c["prompt"] in TRAIN for c in calls)


def test_a_reward_that_exits_in_the_scorer_stops_the_run_naming_it(files, tmp_path,
                                                                   monkeypatch):
    # the job process evaluates the initial policy itself; only the scorer node exits
    (tmp_path / "exits.py").write_text(
        "import os, sys\n\ndef reward(prompt, response):\n"
        "    if os.getpid() != int(os.environ['REWARD_TEST_PID']):\n        sys.exit(3)\n"
        "    return 0.0\n")
    monkeypatch.setenv("REWARD_TEST_PID", str(os.getpid()))
    spec = f"{tmp_path / 'exits.py'}:reward"
    cfg = load_config(None, [
        f"model.path={json.dumps(str(files / 'model'))}", "task.name=text",
        f"task.prompts={json.dumps(str(files / 'prompts.jsonl'))}",
        f"task.reward={json.dumps(spec)}", "task.max_prompt_tokens=32",
        "generation.max_new_tokens=6", "train.steps=3", "train.prompts_per_step=4",
        "algo.group_size=2", "algo.name=grpo", "run.eval_prompts=16", "run.plot=false",
        "run.progress=false", f"run.output_dir={json.dumps(str(tmp_path))}", "run.name=sep",
        "placement.strategy=separation", "placement.devices=2"])
    with pytest.raises(PipelineError) as e:
        job.run(cfg)
    assert str(e.value).startswith(f"scorer0: task.reward: {spec} called sys.exit(3) on "
                                   "prompt "), e.value
    assert "restart" not in str(e.value)

