"""Models named by hub id (`org/name`), found in the local Hugging Face cache only.

Nothing is downloaded at run time: `model.path = "Qwen/Qwen2.5-0.5B-Instruct"` is replaced,
while the config loads, by the directory of that model's snapshot in the cache
(HF_HUB_CACHE, or HF_HOME/hub, or ~/.cache/huggingface/hub), so every later stage (and
`config.json` of the run, hence a resume) sees one fixed directory. A hub id that is not
cached is one error naming what to download and where.
"""

from __future__ import annotations

import re
from pathlib import Path

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
MODEL_KEYS = (("model", "path"), ("reward_model", "path"), ("critic", "path"))


def cached_snapshot(repo_id: str) -> Path | None:
    """The cached snapshot directory of model `repo_id` (its `main` revision); None if
    it is not in the local cache."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None


def hub_cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def resolve_hub_id(value: str, key: str, base_dir: Path | None) -> tuple[str, str | None]:
    """(the path to use, a problem or None) for the model path `value` of config key
    `key`: a directory stays as it is, a hub id becomes its cached snapshot."""
    local = Path(value) if base_dir is None or Path(value).is_absolute() else base_dir / value
    if not value or local.is_dir() or not HUB_ID.match(value):
        return value, None  # a directory (or not one: the directory check says so)
    snapshot = cached_snapshot(value)
    if snapshot is None:
        return value, (f"{key}: {value!r} is neither a directory nor a model in the local "
                       f"Hugging Face cache ({hub_cache()}); nothing is downloaded at run "
                       f"time: fetch it where there is network (huggingface-cli download "
                       f"{value}) into that cache (HF_HUB_CACHE), or give its directory")
    return str(snapshot), None
