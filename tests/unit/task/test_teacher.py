"""teacher.path against the student: one clear ConfigError for another vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import GPT2Config, GPT2LMHeadModel

from rlhf_async.config import ConfigError, JobConfig
from rlhf_async.config.load import load_config
from rlhf_async.task.sort_digits import VOCAB_SIZE
from rlhf_async.task.teacher import check_teacher, teacher_problems
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
