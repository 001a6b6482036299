"""A job: one training run, config to summary (SFT -> reward model -> RL -> evaluation),
on this machine (`run`) or across hosts (`multihost`).

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

__all__ = ["evaluate", "format_summary", "resume_job", "run", "run_config", "run_job"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("rlhf_async.job.local"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
