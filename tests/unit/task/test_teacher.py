"""teacher.path against the student: one clear ConfigError for another vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from rlhf_async.config import ConfigError, JobConfig, PlacementConfig
from rlhf_async.config.load import load_config
from rlhf_async.strategies.registry import build_placement, runner_problems
from rlhf_async.task.rewards.teacher import check_teacher, teacher_device, teacher_problems
from rlhf_async.task.sort_digits import VOCAB_SIZE
from tests.text_model import make_text_model


def _gpt2(d: Path, vocab: int) -> str:
    GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=8, n_layer=1, n_head=2,
                               n_positions=16)).save_pretrained(d)
    return str(d)


def _cfg(teacher: str, model: str = "") -> JobConfig:
    cfg = JobConfig()
    cfg.teacher.path, cfg.model.path = teacher, model
    return cfg


def test_builtin_student_same_vocabulary_is_accepted(tmp_path: Path) -> None:
    check_teacher(_cfg(_gpt2(tmp_path / "t", VOCAB_SIZE)))  # no error


def test_other_vocabulary_is_one_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        check_teacher(_cfg(_gpt2(tmp_path / "t", VOCAB_SIZE + 5)))
    assert len(e.value.problems) == 1
    assert "teacher.path" in e.value.problems[0] and f"{VOCAB_SIZE + 5}" in e.value.problems[0]


def test_other_tokenizer_of_the_same_size_is_an_error(tmp_path: Path) -> None:
    student = make_text_model(tmp_path / "s")
    teacher = make_text_model(tmp_path / "t")
    vocab_file = teacher / "tokenizer.json"
    tok = json.loads(vocab_file.read_text())
    v = tok["model"]["vocab"]
    v["apple"], v["pear"] = v["pear"], v["apple"]  # same size, two ids swapped
    vocab_file.write_text(json.dumps(tok))
    problems = teacher_problems(_cfg(str(teacher), str(student)))
    assert len(problems) == 1 and "another tokenizer" in problems[0]
    assert teacher_problems(_cfg(str(make_text_model(tmp_path / "u")), str(student))) == []


def test_distill_without_teacher_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, ["algo.name=distill"])
    assert any(p.startswith("teacher.path:") for p in e.value.problems)
    with pytest.raises(ConfigError):
        load_config(None, ["algo.distill_coef=0.5"])


def test_teacher_device_of_its_own_per_scorer() -> None:
    cfg = JobConfig()
    gpu, cpu = torch.device("cuda:1"), torch.device("cpu")
    assert teacher_device(cfg, gpu, "scorer0") == gpu  # none given: the scorer's own
    cfg.placement.teacher = [2, 3]
    assert [teacher_device(cfg, gpu, f"scorer{i}") for i in range(3)] == [
        torch.device("cuda:2"), torch.device("cuda:3"), torch.device("cuda:2")]
    assert teacher_device(cfg, cpu, "scorer1") == cpu  # CPU slots are not pinned


def test_placement_teacher_is_separation_s_and_in_range() -> None:
    sep = PlacementConfig(strategy="separation", devices=3, teacher=[2])
    assert build_placement(sep, "distill")[1] == []
    out = build_placement(PlacementConfig(strategy="separation", devices=3, teacher=[3]),
                          "distill")[1]
    assert out == ["placement.teacher: device ids [3] outside 0..2 (placement.devices = 3)"]
    for strategy in ("flattening", "interleaving"):
        out = build_placement(PlacementConfig(strategy=strategy, devices=2, teacher=[1]),
                              "distill")[1]
        assert out == [f"placement.teacher: {strategy} has no scorer processes, which hold "
                       "the teacher on devices of their own (placement.teacher); use "
                       "placement.strategy = separation, or leave placement.teacher empty"]
    ray = JobConfig(placement=PlacementConfig(strategy="separation", devices=3, teacher=[2],
                                              launcher="ray"))
    assert any(p.startswith("placement.teacher:") for p in runner_problems(
        ray, build_placement(ray.placement, "distill")[0]))
