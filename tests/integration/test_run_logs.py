"""Evaluation during RL (`run.eval_every`, `run.keep_best`) and RUN_DIR/samples.jsonl, end to
end on the text task: the eval_* fields land in their steps' records, the kept best policy
is the best evaluated one, the last evaluation is the final one (one evaluation, one key),
evaluating leaves the training trajectory unchanged, and samples.jsonl holds the decoded
samples each step trained on, with their rule rewards."""

from __future__ import annotations

import json

import pytest

from rlhf_async import job
from rlhf_async.config import load_config
from rlhf_async.metrics import read_metrics
from tests.text_model import make_text_model

pytestmark = [pytest.mark.timeout(600)]

PROMPTS = ["name a fruit .", "name a colour .", "list three animal .", "what is the sky ?",
           "give one fruit .", "name a big animal .", "what colour is the sea ?",
           "name a small animal .", "list three colour .", "is the sky blue ?"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("runlogs")
    (d / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    (d / "reward.py").write_text("def words(prompt, response):\n"
                                 "    return len(response.split()) / 5\n")
    make_text_model(d / "model")
    return d


def _run(files, tmp_path, name, *overrides):
    cfg = load_config(None, [
        f"model.path={json.dumps(str(files / 'model'))}", "task.name=text",
        f"task.prompts={json.dumps(str(files / 'prompts.jsonl'))}",
        f"task.reward={json.dumps(str(files / 'reward.py') + ':words')}",
        "generation.max_new_tokens=6", "train.steps=4", "train.prompts_per_step=2",
        "algo.group_size=2", "algo.name=grpo", "algo.max_staleness=0", "train.lr=0.05",
        "run.plot=false",
        "run.progress=false", f"run.output_dir={json.dumps(str(tmp_path))}",
        f"run.name={name}", *overrides])
    summary = job.run(cfg)
    return summary, read_metrics(tmp_path / name / "metrics.jsonl")


def _trajectory(metrics):
    return [m[k] for m in metrics for k in ("reward", "kl", "policy_loss")]


@pytest.fixture(scope="module")
def plain(files, tmp_path_factory):
    """The trajectory without evaluations (Flattening; at staleness 0 every strategy's)."""
    return _trajectory(_run(files, tmp_path_factory.mktemp("plain"), "plain")[1])


@pytest.mark.parametrize("strategy", ["flattening", "separation"])
def test_eval_every_keeps_the_best_and_logs_samples(files, tmp_path, plain, strategy):
    over = [f"placement.strategy={strategy}"] + \
        (["placement.devices=2"] if strategy == "separation" else [])
    summary, metrics = _run(files, tmp_path, "evals", *over, "run.eval_every=2",
                            "run.keep_best=true", "run.log_samples=3")
    evals = {m["step"]: m for m in metrics if "eval_hidden_score" in m}
    assert sorted(evals) == [1, 3] and all("eval_reward" not in m for m in metrics
                                           if m["step"] not in evals)
    # the evaluation after the last step is the final one: same prompts, same noise key
    assert evals[3]["eval_hidden_score"] == pytest.approx(summary["final_hidden_score"])
    best = json.loads((tmp_path / "evals" / "best" / "rlhf_async.json").read_text())
    top = max(evals.values(), key=lambda m: m["eval_hidden_score"])
    assert best["metric"] == "hidden_score" and best["value"] == top["eval_hidden_score"]
    assert best["step"] in evals and (tmp_path / "evals" / "best" / "config.json").exists()
    assert evals[1].get("eval_best") == 1.0  # the first evaluation is the best so far
    # evaluating does not move the training trajectory
    assert _trajectory(metrics) == pytest.approx(plain, rel=1e-4, abs=1e-6)
    lines = read_metrics(tmp_path / "evals" / "samples.jsonl")
    assert [x["step"] for x in lines] == [0, 1, 2, 3]
    for line, m in zip(lines, metrics, strict=True):
        rows = line["samples"]
        assert len(rows) == 3 and rows[0]["group_id"] == rows[1]["group_id"]
        for r in rows:
            assert r["prompt"].replace(" ", "") in {p.replace(" ", "") for p in PROMPTS}
            assert r["reward"] == pytest.approx(len(r["response"].split()) / 5)
            assert r["version"] == m["step"] and isinstance(r["advantage"], float)
        # GRPO, groups of two: a group's advantages are opposite
        assert rows[0]["advantage"] == pytest.approx(-rows[1]["advantage"], abs=1e-5)


def test_dynamic_sampling_trains_on_groups_whose_rewards_vary(files, tmp_path):
    """A 0/1 rule (>= 4 words): groups of equal rewards are dropped and refilled."""
    (tmp_path / "binary.py").write_text("def long(prompt, response):\n"
                                        "    return float(len(response.split()) >= 4)\n")
    _, metrics = _run(files, tmp_path, "dapo", "algo.dynamic_sampling=true",
                      "algo.dynamic_sampling_max_tries=4", "run.log_samples=4",
                      f"task.reward={json.dumps(str(tmp_path / 'binary.py') + ':long')}")
    for m in metrics:
        assert m["samples"] == 4  # 2 prompts x 2, whatever was dropped
        kept = m["dynamic_generated_groups"] - m["dynamic_dropped_groups"]
        assert kept == 2 and m["dynamic_generated_groups"] == 2 * (1 + m["dynamic_refills"])
    assert sum(m["dynamic_dropped_groups"] for m in metrics) > 0  # the rule made some equal
    for line, m in zip(read_metrics(tmp_path / "dapo" / "samples.jsonl"), metrics, strict=True):
        rows = line["samples"]  # all 4 trained samples, in group order
        varied = sum(rows[2 * g]["reward"] != rows[2 * g + 1]["reward"] for g in range(2))
        assert varied == 2 - m["dynamic_filled_groups"]
