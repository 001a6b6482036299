"""A tiny verifiers (v1) environment: repeat a word (README.md beside this package)."""

from vf_repeat.harness import ChatHarness
from vf_repeat.taskset import RepeatTaskset

__all__ = ["ChatHarness", "RepeatTaskset"]
