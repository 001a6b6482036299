"""The best policy kept during RL (`run.keep_best`): written whole, swapped for a new best,
dropped on a resume that trains its step again; the progress line of an evaluation;
several samples per held-out prompt."""

from __future__ import annotations

import io
import json

import torch

from rlhf_async.config import ModelConfig, load_config
from rlhf_async.metrics import Progress
from rlhf_async.modeling.models import load_actor
from rlhf_async.task import make_task
from rlhf_async.task.artefacts import Artefacts
from rlhf_async.task.evaluation import HeldoutEval, _read_best, evaluate
from rlhf_async.task.sort_digits import VOCAB_SIZE


def _evals(tmp_path, start_step=0):
    cfg = load_config(None, ["run.eval_every=2", "run.keep_best=true"])
    task = make_task(cfg)
    art = Artefacts(tmp_path / "sft", None, {}, {})  # no reward model to load
    return HeldoutEval(cfg, task, art, tmp_path, start_step, device=None)


def _save(path, meta):
    path.mkdir(parents=True)
    (path / "rlhf_async.json").write_text(json.dumps(meta))


def test_a_new_best_replaces_the_kept_one_and_a_resume_drops_a_retrained_one(tmp_path):
    ev = _evals(tmp_path)
    assert ev.metric == "hidden_score" and ev.best is None
    assert [ev.due(s) for s in range(4)] == [False, True, False, True]
    ev._keep(1, 0.25, _save)
    ev._keep(3, 0.5, _save)
    assert json.loads((tmp_path / "best" / "rlhf_async.json").read_text())["step"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]  # no temporary left
    assert _evals(tmp_path, start_step=4).best == 0.5  # a resume after it keeps it
    assert _evals(tmp_path, start_step=3).best is None  # step 3 is trained again
    assert not (tmp_path / "best").exists() and _read_best(tmp_path / "best", 9) is None


def test_an_evaluation_prints_its_line_under_the_progress_bar():
    out = io.StringIO()
    p = Progress(4, stream=out)
    p.update({"step": 1, "reward": 0.5, "eval_hidden_score": 0.75, "eval_reward": 0.5,
              "eval_response_length": 6.0, "eval_best": 1.0})
    assert "[rl] eval after step 2 | hidden 0.750 | reward 0.500 | len 6.000 (best so far, " \
           "kept)" in out.getvalue()


def test_eval_samples_scores_each_held_out_prompt_that_many_times():
    """`run.eval_samples = k`: k sampled responses per held-out prompt, all averaged."""

    one = load_config(None, ["run.eval_prompts=6", "run.progress=false"])
    three = load_config(None, ["run.eval_prompts=6", "run.eval_samples=3",
                               "run.progress=false"])
    task = make_task(one)
    actor = load_actor(ModelConfig(hidden=32, heads=2, layers=1), VOCAB_SIZE,
                       task.special, seed=0)
    a, b = evaluate(actor, None, task, one), evaluate(actor, None, task, three)
    assert (a["prompts"], a["samples"]) == (6, 6) and (b["prompts"], b["samples"]) == (6, 18)
    assert torch.isfinite(torch.tensor([b["hidden_score"], b["reward"]])).all()
    assert a["hidden_score"] != b["hidden_score"]  # more responses went into the mean


def test_the_evaluation_bar_shows_a_hidden_score_only_beside_a_reward_model(capsys):
    """Without a reward model the built-in task's rule is the reward: one column, not two
    showing the same number."""
    cfg = load_config(None, ["run.eval_prompts=4"])
    task = make_task(cfg)
    actor = load_actor(ModelConfig(hidden=32, heads=2, layers=1), VOCAB_SIZE,
                       task.special, seed=0)
    evaluate(actor, None, task, cfg, label="initial")
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "[eval initial" in line and "| reward " in line and "hidden" not in line, line
