"""A job: one training run, config to summary (SFT -> reward model -> RL -> evaluation),
on this machine or a Ray cluster (`run`); or one supervised stage on the
user's data (`sft_stage`, `reward_model_stage`).

The names below load `job.local` (torch, transformers: seconds) on first use, so that what
needs only the run directory's lock (`rlhf-async stop`) starts in a fraction of that."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlhf_async.job.local import (
        evaluate,
        format_summary,
        resume_job,
        run,
        run_config,
        run_job,
    )
    from rlhf_async.job.stages import reward_model_stage, sft_stage

_HOMES = {"evaluate": "local", "format_summary": "local", "resume_job": "local", "run": "local",
          "run_config": "local", "run_job": "local", "sft_stage": "stages",
          "reward_model_stage": "stages"}
__all__ = ["evaluate", "format_summary", "resume_job", "reward_model_stage", "run",
           "run_config", "run_job", "sft_stage"]


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(f"rlhf_async.job.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
