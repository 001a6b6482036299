"""The user's rows (prompts, demonstrations, preference pairs) from a file, a directory or
a dataset id in the local Hugging Face cache.

Sources, by what the config value names:
- `.jsonl`: one JSON object per line, read here (errors name the line); `.txt` (or any
  other suffix not below): one value per line, in the column `text_column`;
- `.json`, `.parquet`, `.arrow`, `.csv`: read with `datasets` (extra `[data]`);
- a directory: `Dataset.save_to_disk`'s (load_from_disk), else a folder of data files;
- a dataset id (`org/name`): resolved to its snapshot in the local HF cache while the
  config loads (`config/hub.py`), so here it is a directory.
A `DatasetDict` gives the split named by the stage's `split` key. Rows are plain dicts; the
stage that reads them checks their columns (`text.py`, `user_data.py`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlhf_async.config import ConfigError
from rlhf_async.engines.extras import MissingExtraError, require_extra

Row = dict[str, Any]
DATASETS_SUFFIXES = {".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
SAVED_MARKERS = ("state.json", "dataset_dict.json")  # what save_to_disk writes


def load_rows(source: str, key: str, split: str = "train", text_column: str = "text",
              ) -> list[Row]:
    """Every row of `source` (config key `key`), in order; one ConfigError when it cannot
    be read or holds no rows."""
    p = Path(source)
    if not source:
        raise ConfigError([f"{key}: empty; give a data file, a directory or a dataset id"])
    if p.is_file() and p.suffix == ".jsonl":
        rows = _read_jsonl(p, key)
    elif p.is_file() and p.suffix not in DATASETS_SUFFIXES:
        rows = _read_lines(p, key, text_column)
    elif p.exists():
        rows = _read_with_datasets(p, key, split)
    else:
        raise ConfigError([f"{key}: {source!r} is neither a file, a directory nor a dataset "
                           "in the local Hugging Face cache"])
    if not rows:
        raise ConfigError([f"{key}: {source!r} holds no rows"])
    return rows


def _read_jsonl(p: Path, key: str) -> list[Row]:
    rows, problems = [], []
    for n, line in enumerate(_text(p, key).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            problems.append(f"{key}: {p}:{n}: not JSON ({e})")
            continue
        if not isinstance(row, dict):
            problems.append(f"{key}: {p}:{n}: expected a JSON object, got "
                            f"{type(row).__name__}")
            continue
        rows.append(row)
    if problems:
        raise ConfigError(problems[:20])
    return rows


def _read_lines(p: Path, key: str, column: str) -> list[Row]:
    return [{column: line.strip()} for line in _text(p, key).splitlines() if line.strip()]


def _text(p: Path, key: str) -> str:
    try:
        return p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError([f"{key}: cannot read {str(p)!r} ({e})"]) from None


def _read_with_datasets(p: Path, key: str, split: str) -> list[Row]:
    try:
        require_extra("datasets", "datasets", "data")
    except MissingExtraError as e:
        raise ConfigError([f"{key}: reading {str(p)!r} needs `datasets`: {e} (.jsonl and "
                           ".txt files need nothing)"]) from None
    import datasets

    datasets.disable_progress_bars()
    try:
        if p.is_file():
            loaded: Any = datasets.load_dataset(DATASETS_SUFFIXES[p.suffix],
                                                data_files=str(p), split="train")
        elif any((p / m).exists() for m in SAVED_MARKERS):
            loaded = datasets.load_from_disk(str(p))
        else:
            loaded = datasets.load_dataset(str(p))
    except Exception as e:  # datasets raises many kinds; each is the file's
        raise ConfigError([f"{key}: cannot read {str(p)!r} as a dataset "
                           f"({type(e).__name__}: {e})"]) from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            stage = key.rsplit(".", 1)[0]
            raise ConfigError([f"{key}: {str(p)!r} has no split {split!r} ({stage}.split); "
                               f"its splits: {sorted(loaded)}"])
        loaded = loaded[split]
    return list(loaded.to_list())
