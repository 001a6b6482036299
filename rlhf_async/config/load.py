"""Loading a `JobConfig`: TOML and dotted overrides, every field type- and range-checked,
then the cross-field checks; all problems together in one `ConfigError`."""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
import typing
from pathlib import Path
from typing import Any

from rlhf_async.config.checks import cross_checks
from rlhf_async.config.fields import ConfigError
from rlhf_async.config.hub import DATA_KEYS, MODEL_KEYS, resolve_hub_id
from rlhf_async.config.schema import (
    TASK_DEFAULTS,
    JobConfig,
)
from rlhf_async.config.sizing import SIZED_KEYS, apply_model_defaults
from rlhf_async.config.task import adapter_syntax
from rlhf_async.log import get_logger

log = get_logger(component="config")


def _section_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is list:
        return f"list of {typing.get_args(tp)[0].__name__}"
    if typing.get_origin(tp) is dict:
        return "table (key = value, ...)"
    return {int: "integer", float: "number", bool: "true/false", str: "string"}.get(tp, str(tp))


def _coerce(tp: Any, value: Any) -> tuple[bool, Any]:
    """Check `value` against a field type; returns (ok, value converted where lossless)."""
    if typing.get_origin(tp) is list:
        inner = typing.get_args(tp)[0]
        if not isinstance(value, list):  # one value where a list goes: a list of one
            ok, one = _coerce(inner, value)
            return ok, [one] if ok else value
        items = [_coerce(inner, v) for v in value]
        return all(ok for ok, _ in items), [v for _, v in items]
    if typing.get_origin(tp) is dict:  # a free-form table, checked by what reads it
        return isinstance(value, dict), value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else value
    if tp is str:
        return isinstance(value, str), value
    return False, value


def _check_value(path: str, f: dataclasses.Field, value: Any) -> list[str]:
    m = f.metadata
    out = []
    if m.get("choices") is not None and value not in m["choices"]:
        out.append(f"{path}: {value!r} is not one of {', '.join(map(repr, m['choices']))}")
    values = value if isinstance(value, list) else [value]
    for v in values:
        if isinstance(v, float) and not math.isfinite(v):  # nan passes every comparison
            out.append(f"{path}: {v!r} is not a finite number")
            continue
        if m.get("ge") is not None and v < m["ge"]:
            out.append(f"{path}: {v!r} is below the minimum {m['ge']}")
        if m.get("gt") is not None and v <= m["gt"]:
            out.append(f"{path}: {v!r} must be greater than {m['gt']}")
        if m.get("le") is not None and v > m["le"]:
            out.append(f"{path}: {v!r} is above the maximum {m['le']}")
    return out


def _build(cls: type, data: dict[str, Any], prefix: str, problems: list[str]) -> Any:
    types_ = _section_types(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if path in REMOVED:
            problems.append(f"{path}: removed; {REMOVED[path]}")
            continue
        if key not in fields:
            problems.append(f"{path}: unknown key; accepted: {', '.join(fields)}")
            continue
        tp = types_[key]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                problems.append(f"{path}: expected a table/section, got {value!r}")
                continue
            kwargs[key] = _build(tp, value, path + ".", problems)
            continue
        ok, converted = _coerce(tp, value)
        if not ok:
            problems.append(f"{path}: expected {_type_name(tp)}, got {value!r}")
            continue
        bad = _check_value(path, fields[key], converted)
        problems.extend(bad)
        if not bad:
            kwargs[key] = converted
    return cls(**kwargs)


def _add_cross_checks(cfg: JobConfig, problems: list[str]) -> None:
    """Cross-field checks run on the fields that parsed (bad ones are at their defaults);
    a key that already has a problem is not reported twice."""
    seen = {p.split(":", 1)[0] for p in problems}
    problems.extend(p for p in cross_checks(cfg) if p.split(":", 1)[0] not in seen)


def parse_override(item: str) -> tuple[list[str], Any]:
    """'a.b=value' -> (['a', 'b'], value); the value is read as TOML, else as a bare string."""
    if "=" not in item:
        raise ConfigError([f"override {item!r}: expected key.path=value"])
    key, raw = item.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError as e:
        if raw.strip()[:1] in ("\"", "'", "[", "{"):  # meant as TOML, but broken
            raise ConfigError([(f"override {item!r}: the value is not valid TOML ({e}); "
                                "quote a whole string, e.g. key=\"a/b\"")]) from None
        value = raw.strip()
    return key.strip().split("."), value


# fields holding a file or directory path: relative ones resolve against the working
# directory of whoever wrote them (`base_dir`), not of the process that runs the job
PATH_KEYS = (("model", "path"), ("reward_model", "path"), ("critic", "path"),
             ("task", "prompts"), ("sft", "data"), ("reward_model", "data"),
             ("placement", "calibration"))
# keys that were removed, with what replaces them
REMOVED = {"placement.hosts_file": "multi-host runs place their nodes on a Ray cluster: "
                                   "placement.launcher = 'ray' (deploy/README.md)",
           "placement.host": "on a Ray cluster the placement group places each device",
           "placement.backend": "each engine is chosen once for the job: train.backend "
                                "(actor and critic) and generation.backend (the generators)"}
# older names still read, with a warning naming what replaces them
DEPRECATED = {"algo.is_cap": "algo.mismatch = 'tis' with algo.mismatch_cap = the cap"}


def _resolve_hub_ids(cfg: JobConfig, base_dir: Path | None, problems: list[str]) -> None:
    """Model and data paths that name a hub id become their snapshot in the local HF
    cache."""
    keys = [(s, k, "model") for s, k in MODEL_KEYS] + [(s, k, "dataset") for s, k in DATA_KEYS]
    for section, key, repo_type in keys:
        obj = getattr(cfg, section)
        value, problem = resolve_hub_id(getattr(obj, key), f"{section}.{key}", base_dir,
                                        repo_type)
        setattr(obj, key, value)
        if problem:
            problems.append(problem)


def _resolve_paths(cfg: JobConfig, base_dir: Path) -> None:
    for section, key in PATH_KEYS:
        value = getattr(getattr(cfg, section), key)
        if value and not Path(value).is_absolute() and not adapter_syntax(value):
            setattr(getattr(cfg, section), key, str(base_dir / value))
    where, sep, name = cfg.task.reward.rpartition(":")
    if sep and where.endswith(".py") and not Path(where).is_absolute():  # a file, not a module
        cfg.task.reward = f"{base_dir / where}:{name}"


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, *,
                text: str | None = None, base_dir: str | Path | None = None) -> JobConfig:
    """Load TOML or JSON (optional) then apply dotted overrides; raise ConfigError listing
    all problems. `text`: the file's text, `path` only naming it in errors. `base_dir`:
    where relative paths of `PATH_KEYS` (and a task.reward file) start, instead of the
    working directory."""
    data: dict[str, Any] = {}
    problems: list[str] = []
    if path is not None:
        # a .json file is a run's config.json (`to_dict`), e.g. what a Ray rank starts from
        kind = "JSON" if str(path).endswith(".json") else "TOML"
        try:
            raw = Path(path).read_text() if text is None else text
            data = json.loads(raw) if kind == "JSON" else tomllib.loads(raw)
        except FileNotFoundError:
            raise ConfigError([f"config file {str(path)!r}: not found"]) from None
        except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError([f"config file {str(path)!r}: not valid {kind} ({e})"]) from None
        if not isinstance(data, dict):
            raise ConfigError([f"config file {str(path)!r}: not a table of sections"])
    for item in overrides or []:
        try:
            keys, value = parse_override(item)
        except ConfigError as e:
            problems.extend(e.problems)
            continue
        node = data
        for k in keys[:-1]:
            nxt = node.setdefault(k, {})
            if not isinstance(nxt, dict):
                problems.append(f"override {item!r}: {k} is not a section")
                break
            node = nxt
        else:
            node[keys[-1]] = value
    _task_defaults(data)
    _warn_deprecated(data)
    cfg = _build(JobConfig, data, "", problems)
    _resolve_hub_ids(cfg, None if base_dir is None else Path(base_dir), problems)
    if base_dir is not None:
        _resolve_paths(cfg, Path(base_dir))
    _size_to_model(cfg, data)
    _add_cross_checks(cfg, problems)
    if problems:
        raise ConfigError(problems)
    return cfg


def _size_to_model(cfg: JobConfig, data: dict[str, Any]) -> None:
    """The learning rates the file and the overrides leave unset, sized to model.path
    (`sizing.py`); logged, so that a run's log says where its values came from."""
    given = {f"{section}.{key}" for section, key in SIZED_KEYS
             if isinstance(data.get(section), dict) and key in data[section]}
    sized = apply_model_defaults(cfg, given)
    if sized:
        log.info("defaults sized to model.path", model=cfg.model.path,
                 **{s.key: s.value for s in sized})


def _warn_deprecated(data: dict[str, Any]) -> None:
    """One warning per older key the file or the overrides turn on (`DEPRECATED`; the
    reference file's 0 leaves it off)."""
    for path, instead in DEPRECATED.items():
        section, _, key = path.partition(".")
        given = data.get(section)
        if isinstance(given, dict) and given.get(key):
            log.warning("deprecated config key", key=path, value=given[key], use=instead)


def _task_defaults(data: dict[str, Any]) -> None:
    """Fill in the named task's own defaults (`TASK_DEFAULTS`) for keys the file and the
    overrides leave unset."""
    task = data.get("task")
    name = task.get("name") if isinstance(task, dict) else None
    for section, values in TASK_DEFAULTS.get(name, {}).items() if isinstance(name, str) else ():
        given = data.setdefault(section, {})
        if isinstance(given, dict):
            for key, value in values.items():
                given.setdefault(key, value)


def config_from_dict(data: dict[str, Any]) -> JobConfig:
    """A JobConfig from its `to_dict` form (e.g. shipped to a node); same checks as TOML."""
    problems: list[str] = []
    cfg = _build(JobConfig, data, "", problems)
    _add_cross_checks(cfg, problems)
    if problems:
        raise ConfigError(problems)
    return cfg
