"""`task.max_prompt_tokens = 0` (the default) takes the longest prompt in the data: a GPT-2
with 128 positions and 5-token prompts runs with no length override (a fixed default of
256 refused it), and a prompt file that does not fit the context is refused naming it."""

from __future__ import annotations

import json

import pytest

from rlhf_async import job
from rlhf_async.config import ConfigError, load_config
from rlhf_async.metrics import read_metrics
from rlhf_async.planning.machine import workload_of
from rlhf_async.task import make_task
from tests.text_model import make_text_model

pytestmark = [pytest.mark.timeout(300)]

PROMPTS = ["name a fruit", "name a colour", "list three animal", "what is red",
           "give one fruit", "name a dog"]  # <user> + 3 words + <bot>: 5 tokens


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("context")
    (d / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    (d / "reward.py").write_text("def words(prompt, response):\n"
                                 "    return float(len(response.split()))\n")
    make_text_model(d / "model", positions=128)
    return d


def _cfg(files, tmp_path, *more):
    return load_config(None, [
        f"model.path={json.dumps(str(files / 'model'))}", "task.name=text",
        f"task.prompts={json.dumps(str(files / 'prompts.jsonl'))}",
        f"task.reward={json.dumps(str(files / 'reward.py') + ':words')}",
        "train.steps=2", "train.prompts_per_step=2", "algo.group_size=2", "algo.name=grpo",
        "run.plot=false", "run.progress=false", f"run.output_dir={json.dumps(str(tmp_path))}",
        "run.name=r", *more])


def test_a_128_position_model_runs_without_a_length_override(files, tmp_path):
    cfg = _cfg(files, tmp_path)
    assert cfg.task.max_prompt_tokens == 0
    assert make_task(cfg).prompt_len == 5 == workload_of(cfg).prompt_len
    job.run(cfg)
    assert len(read_metrics(tmp_path / "r" / "metrics.jsonl")) == 2


def test_the_data_longest_prompt_must_fit_the_context(files, tmp_path):
    cfg = _cfg(files, tmp_path, "generation.max_new_tokens=124")
    with pytest.raises(ConfigError, match=r"up to 5 tokens \(the longest prompt in "
                                          r"task.prompts.*needs 129 positions"):
        make_task(cfg)
    with pytest.raises(ConfigError, match=r"up to 256 tokens \(task.max_prompt_tokens\)"):
        _cfg(files, tmp_path, "task.max_prompt_tokens=256")  # explicit: refused as before
