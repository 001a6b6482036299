"""A job: one training run, config to summary (SFT -> reward model -> RL -> evaluation),
on this machine (`run`) or across hosts (`multihost`)."""

from rlhf_async.job.local import evaluate, format_summary, resume_job, run, run_config, run_job

__all__ = ["evaluate", "format_summary", "resume_job", "run", "run_config", "run_job"]
