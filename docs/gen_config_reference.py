"""The config reference page (docs/reference/config.md), rendered from the dataclasses in
rlhf_async/config/ like configs/reference.toml, so it cannot drift from the code: a test
compares the committed page with `render()`. Regenerate with
`python docs/gen_config_reference.py`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from rlhf_async.config.presets import PRESETS, AlgoConfig, resolve
from rlhf_async.config.reference import _toml_value
from rlhf_async.config.schema import JobConfig

INTRO = """# Config reference

Every key of a job's config, its default and what it accepts, generated from the dataclasses
in `rlhf_async/config/` (`python docs/gen_config_reference.py`; do not edit by hand).
`configs/reference.toml` is the same, as a TOML file to copy from.

A job's config is a TOML file, `key=value` overrides on the command line, or both
(`rlhf-async run my.toml algo.name=grpo train.steps=100`); every wrong key, type or value is
reported together in one error. `rlhf-async run --dry-run ...` runs every check and prints each
value that was sized for your model and where it came from.
"""


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell (no column breaks, no raw HTML, no emphasis)."""
    for raw, safe in (("\\", "\\\\"), ("|", "\\|"), ("<", "&lt;"), (">", "&gt;"),
                      ("*", "\\*")):
        text = text.replace(raw, safe)
    return text


def _accepts(f: dataclasses.Field[Any]) -> str:
    m = f.metadata
    if m.get("choices"):
        return ", ".join(f"`{_toml_value(c)}`" for c in m["choices"])
    bounds = [f"{op} {m[key]}" for key, op in (("ge", ">="), ("gt", ">"), ("le", "<="))
              if m.get(key) is not None]
    kind = f"`{f.type}`" if isinstance(f.type, str) else f"`{getattr(f.type, '__name__', f.type)}`"
    return f"{kind} {', '.join(bounds)}".strip()


def section(name: str, obj: Any) -> list[str]:
    lines = [f"## `[{name}]`", "", "| key | default | accepts | what it does |",
             "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(obj):
        default = _cell(_toml_value(getattr(obj, f.name)))
        lines.append(f"| `{name}.{f.name}` | `{default}` | {_cell(_accepts(f))} | "
                     f"{_cell(f.metadata['help'])} |")
    return [*lines, ""]


def presets() -> list[str]:
    """What each `algo.name` preset resolves to (a knob you set yourself wins)."""
    recipes = {n: resolve(AlgoConfig(name=n)) for n in PRESETS}
    knobs = [f.name for f in dataclasses.fields(next(iter(recipes.values())))]
    lines = ["## What each `algo.name` sets", "",
             "The `[algo]` knobs left at their preset's value take the preset's; a value you "
             "set wins. What each preset resolves to (the `Recipe` the learner reads, "
             "`rlhf_async/config/presets.py`):", "",
             "| recipe field | " + " | ".join(f"`{n}`" for n in recipes) + " |",
             "| --- |" + " --- |" * len(recipes)]
    for k in knobs:
        row = [_cell(_toml_value(getattr(r, k))) if _plain(getattr(r, k)) else "(function)"
               for r in recipes.values()]
        lines.append(f"| `{k}` | " + " | ".join(row) + " |")
    return [*lines, ""]


def _plain(v: Any) -> bool:
    return isinstance(v, bool | int | float | str | list | dict) or v is None


def render() -> str:
    root = JobConfig()
    lines = [INTRO]
    lines += [f"- [`[{s.name}]`](#{s.name})" for s in dataclasses.fields(root)]
    lines.append("")
    for s in dataclasses.fields(root):
        lines += section(s.name, getattr(root, s.name))
    lines += presets()
    return "\n".join(lines)


PAGE = Path(__file__).resolve().parent / "reference" / "config.md"

if __name__ == "__main__":
    PAGE.parent.mkdir(exist_ok=True)
    PAGE.write_text(render())
