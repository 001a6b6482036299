import json
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from structlog.testing import capture_logs

from rlhf_async.config import AlgoConfig, ConfigError, JobConfig, load_config
from rlhf_async.config.presets import PRESETS, resolve, with_critic
from rlhf_async.config.reference import render as render_reference

REPO = Path(__file__).resolve().parents[3]


def test_defaults_load_and_reference_file_matches_generated():
    assert load_config(None, []) == JobConfig()
    committed = (REPO / "configs" / "reference.toml").read_text()
    assert committed == render_reference(), "regenerate: python -m rlhf_async.config.reference"
    assert load_config(REPO / "configs" / "reference.toml", []) == JobConfig()


def test_overrides_are_typed():
    cfg = load_config(None, ["algo.name=grpo", "train.lr=1e-5", "train.steps=3",
                             "run.name=abc", "placement.actor=[0,1]", "algo.is_cap=2"])
    assert cfg.algo.name == "grpo" and cfg.train.lr == 1e-5 and cfg.train.steps == 3
    assert cfg.run.name == "abc" and cfg.placement.actor == [0, 1]
    assert isinstance(cfg.algo.is_cap, float) and cfg.algo.is_cap == 2.0


def test_toml_file_then_override(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[train]\nsteps = 7\n[algo]\nname = "rloo"\n')
    cfg = load_config(f, ["train.steps=9"])
    assert cfg.train.steps == 9 and cfg.algo.name == "rloo"


def test_all_problems_reported_together(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[train]\nstep = 7\nlr = "fast"\n[algo]\nname = "dpo"\n[nope]\nx = 1\n')
    with pytest.raises(ConfigError) as ei:
        load_config(f, ["generation.temperature=-1", "oops"])
    probs = ei.value.problems
    text = str(ei.value)
    for needle in ["train.step: unknown key", "train.lr: expected number", "algo.name: 'dpo'",
                   "nope: unknown key", "generation.temperature",
                   "override 'oops'"]:
        assert any(needle in p for p in probs), (needle, probs)
    assert "accepted" in text and "'ppo'" in text
    assert len(probs) == 6


def test_cross_field_checks():
    with pytest.raises(ConfigError) as ei:
        load_config(None, ["algo.name=grpo", "algo.group_size=1", "task.min_len=7"])
    joined = "\n".join(ei.value.problems)
    assert "algo.group_size" in joined and "task.min_len" in joined


def test_bad_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml", [])
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad, [])


def test_override_that_looks_like_toml_but_is_broken_is_an_error():
    with pytest.raises(ConfigError, match="not valid TOML.*quote a whole string"):
        load_config(None, ['run.cache_dir="/tmp/x"/c'])
    assert load_config(None, ["run.cache_dir=/tmp/x/c"]).run.cache_dir == "/tmp/x/c"


def test_prompt_plus_response_must_fit_the_models_context(tmp_path):
    # built-in: BOS + 6 digits + SEP = 8 prompt tokens; 100 new tokens would pass position 64
    with pytest.raises(ConfigError) as ei:
        load_config(None, ["generation.max_new_tokens=100"])
    (problem,) = ei.value.problems
    assert problem.startswith("generation.max_new_tokens: a prompt of up to 8 tokens")
    assert "108 positions, over the model's context of 64 (model.max_positions)" in problem
    assert load_config(None, ["generation.max_new_tokens=56"]).generation.max_new_tokens == 56
    # model.path: the HF config's own limit, whichever key the architecture uses
    for key in ("n_positions", "max_position_embeddings"):
        model = tmp_path / key
        model.mkdir()
        (model / "config.json").write_text(f'{{"{key}": 32}}')
        with pytest.raises(ConfigError, match=f"context of 32 \\({key} in "):
            load_config(None, [f"model.path={str(model)!r}", "generation.max_new_tokens=30"])
        assert load_config(None, [f"model.path={str(model)!r}",
                                  "generation.max_new_tokens=24"]).model.path == str(model)


def test_stop_strings_need_the_text_task_and_no_empty_one():
    # (an engine that cannot match them: tests/unit/strategies/test_engine_problems.py)
    with pytest.raises(ConfigError) as ei:
        load_config(None, ['generation.stop_strings=["</answer>", ""]'])
    probs = [p for p in ei.value.problems if p.startswith("generation.stop_strings: ")]
    assert len(probs) == 2, ei.value.problems
    assert "holds an empty string" in probs[0]
    assert "task.name = 'sort_digits' has no text" in probs[1] and "task.name = 'text'" in probs[1]
    assert load_config(None, []).generation.stop_strings == []


def test_non_finite_numbers_and_run_names_outside_the_output_dir_are_refused():
    with pytest.raises(ConfigError) as ei:
        load_config(None, ["train.lr=nan", "algo.kl_coef=inf", "runtime.time_to_dead=-inf",
                           "run.name=.."])
    assert sorted(ei.value.problems) == [
        "algo.kl_coef: inf is not a finite number",
        "run.name: '..' must name one directory inside run.output_dir (no '/', '\\', '.' or "
        "'..')",
        "runtime.time_to_dead: -inf is not a finite number",
        "train.lr: nan is not a finite number"]
    for name in ("a/b", ".", "../x", "a\\b"):
        with pytest.raises(ConfigError, match="run.name: "):
            load_config(None, [f"run.name={name}"])
    assert load_config(None, ["run.name=my-run.2"]).run.name == "my-run.2"


def test_a_damaged_model_directory_is_a_config_error_not_a_traceback(tmp_path):
    good = tmp_path / "good"
    good.mkdir()
    (good / "config.json").write_text('{"model_type": "gpt2"}')
    save_file({"w": torch.zeros(64, 64)}, str(good / "model.safetensors"))
    assert load_config(None, [f"model.path={json.dumps(str(good))}"]).model.path == str(good)
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "config.json").write_text('{"model_type": "gpt2"}')
    data = (good / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    for d, want in ((cut, "model.safetensors is damaged (truncated, or not safetensors)"),
                    (bad, "config.json is not JSON")):
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"model.path={json.dumps(str(d))}"])
        assert len(e.value.problems) == 1 and want in e.value.problems[0], e.value.problems


def test_a_removed_key_names_its_replacement_and_an_older_name_warns():
    with pytest.raises(ConfigError) as e:  # the engines are train.backend and generation.backend
        load_config(None, ['placement.backend=["actor=deepspeed"]', "train.backend=deepspeed"])
    assert e.value.problems == [
        "placement.backend: removed; each engine is chosen once for the job: train.backend "
        "(actor and critic: torch | deepspeed) and generation.backend (the generators: "
        "torch | vllm | sim)"]
    with capture_logs() as logs:
        cfg = load_config(None, ["algo.name=grpo", "algo.is_cap=3"])
    recipe = resolve(cfg.algo)  # still read: TIS with that cap
    assert (recipe.mismatch, recipe.mismatch_cap) == ("tis", 3.0)
    assert [(x["event"], x["key"], x["value"]) for x in logs] == [
        ("deprecated config key", "algo.is_cap", 3)]
    assert "algo.mismatch = 'tis'" in logs[0]["use"]
    with capture_logs() as logs:  # the new names, or the reference file's is_cap = 0: silent
        load_config(None, ["algo.mismatch=tis", "algo.mismatch_cap=3", "algo.is_cap=0"])
    assert logs == []


def test_algo_name_accepts_exactly_the_presets():
    assert fields(AlgoConfig)[0].metadata["choices"] == tuple(PRESETS)
    with pytest.raises(ConfigError, match=r"algo.name: 'ppo2' is not one of 'ppo', 'grpo'"):
        load_config(None, ["algo.name=ppo2"])
    assert with_critic() == ["ppo"]  # what `critic.path` is for
    with pytest.raises(ConfigError, match="critic.path: rloo trains no critic; it is for "
                       "algo.name = 'ppo'"):
        load_config(None, ["algo.name=rloo", "critic.path=/nowhere"])
