"""What every config section is made of: a field with its help text and accepted values
(`opt`), and the one error that lists every problem (`ConfigError`)."""

from __future__ import annotations

from dataclasses import field
from typing import Any


class ConfigError(ValueError):
    """Invalid configuration; `problems` lists every issue as 'key.path: what is wrong'."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid configuration ({len(self.problems)} problem(s)):\n{lines}")


def opt(default: Any, help: str, *, choices: tuple[Any, ...] | None = None,
        ge: float | None = None, gt: float | None = None, le: float | None = None,
        adapter: str | None = None) -> Any:
    """A config field with its help text and accepted values (used by validation and docs).
    `adapter`: the field is the knobs of the environment adapter whose prefix is the
    field's name, named in that key of the same section (`task.verifiers`: 'env')."""
    meta = {"help": help, "choices": choices, "ge": ge, "gt": gt, "le": le,
            "adapter": adapter}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=meta)
    return field(default=default, metadata=meta)
