"""On-policy distillation's teacher (`teacher.path`): checked against the student before
anything runs, and loaded frozen wherever the reference model is (the scorer under
Separation; every rank or the reference's owners under Flattening and Interleaving).

The teacher scores the student's own token ids, so both must index one vocabulary: the
same number of token ids, and (when both have tokenizer files) the same token -> id map.
Nothing re-tokenises by text. The teacher is frozen and always reloaded from `teacher.path`,
so a resumed run has the same teacher without it being in a checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from rlhf_async.config import ConfigError, JobConfig
from rlhf_async.modeling.models import freeze
from rlhf_async.modeling.precision import Precision
from rlhf_async.task.calculator import VOCAB_SIZE as CALC_VOCAB
from rlhf_async.task.sort_digits import VOCAB_SIZE


def _vocab_size(path: str) -> int | None:
    try:
        v = getattr(AutoConfig.from_pretrained(path, local_files_only=True), "vocab_size", None)
    except (OSError, ValueError) as e:
        raise ConfigError([f"teacher.path: cannot read the model config of {path!r} ({e})"]) \
            from None
    return v if isinstance(v, int) else None


def _vocab(path: str) -> dict[str, int] | None:
    """`path`'s token -> id map, or None without tokenizer files."""
    try:
        tok: Any = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError):
        return None
    # no tokenizer files: transformers may build an empty one from the config
    return tok.get_vocab() if tok("a b c 1 2 3")["input_ids"] else None


def student_vocab_size(cfg: JobConfig) -> int:
    """The student's vocabulary: model.path's, else the built-in task's model's."""
    if cfg.model.path:
        size = _vocab_size(cfg.model.path)
        if size is not None:
            return size
    return CALC_VOCAB if cfg.task.name == "calculator" else VOCAB_SIZE


def teacher_problems(cfg: JobConfig) -> list[str]:
    """Why `teacher.path` cannot teach this job's student (one line each; [] = it can)."""
    path = cfg.teacher.path
    if not path:
        return []
    theirs, ours = _vocab_size(path), student_vocab_size(cfg)
    if theirs != ours:
        return [f"teacher.path: {path!r} has a vocabulary of {theirs} token ids, the student "
                f"({cfg.model.path or 'the built-in ' + cfg.task.name + ' model'}) {ours}; "
                "distillation compares log-probs of the same token ids, so the teacher needs "
                "the student's tokenizer and vocabulary"]
    if cfg.model.path:
        t_vocab, s_vocab = _vocab(path), _vocab(cfg.model.path)
        if t_vocab is not None and s_vocab is not None and t_vocab != s_vocab:
            differ = sum(1 for k, v in t_vocab.items() if s_vocab.get(k) != v)
            return [f"teacher.path: {path!r} has another tokenizer than model.path "
                    f"{cfg.model.path!r} ({differ} of its {len(t_vocab)} tokens map to "
                    "other ids); the teacher must use the student's tokenizer"]
    return []


def check_teacher(cfg: JobConfig) -> None:
    """Raise one ConfigError when `teacher.path` cannot teach this job's student."""
    problems = teacher_problems(cfg)
    if problems:
        raise ConfigError(problems)


def teacher_device(cfg: JobConfig, device: torch.device, node_id: str) -> torch.device:
    """Where Separation's scorer `node_id` (scorer<i>) holds the teacher: on GPUs
    `placement.teacher[i mod n]` when given (a device of its own, as the reference's are
    placed), else the scorer's own `device` (CPU slots are not pinned: one device)."""
    own = cfg.placement.teacher
    if not own or device.type != "cuda":
        return device
    index = node_id.removeprefix("scorer")
    return torch.device(f"cuda:{own[int(index) % len(own)] if index.isdigit() else own[0]}")


def load_teacher(cfg: JobConfig, device: torch.device,
                 precision: Precision) -> torch.nn.Module | None:
    """The frozen teacher on `device`, held in the reference model's dtype (it is placed
    like the reference); None when the job distils from none."""
    if not cfg.teacher.path:
        return None
    model = AutoModelForCausalLM.from_pretrained(str(Path(cfg.teacher.path)),
                                                 local_files_only=True).float().eval()
    return precision.hold("reference", freeze(model).to(device))  # type: ignore[arg-type]
