"""Models and datasets named by hub id (`org/name`), found in the local Hugging Face cache
only.

Nothing is downloaded at run time: `model.path = "Qwen/Qwen2.5-0.5B-Instruct"` (or
`task.prompts = "openai/gsm8k"`) is replaced, while the config loads, by the directory of
that repository's snapshot in the cache (HF_HUB_CACHE, or HF_HOME/hub, or
~/.cache/huggingface/hub), so every later stage (and `config.json` of the run, hence a
resume) sees one fixed directory. A hub id that is not cached is one error naming what to
download and where. A local path of the same name wins.
"""

from __future__ import annotations

import re
from pathlib import Path

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
MODEL_KEYS = (("model", "path"), ("reward_model", "path"), ("critic", "path"),
              ("teacher", "path"))
DATA_KEYS = (("task", "prompts"), ("sft", "data"), ("reward_model", "data"))


def cached_snapshot(repo_id: str, repo_type: str = "model") -> Path | None:
    """The cached snapshot directory of `repo_id` (a model or a dataset, its `main`
    revision); None if it is not in the local cache."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None


def hub_cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def resolve_hub_id(value: str, key: str, base_dir: Path | None, repo_type: str = "model",
                   ) -> tuple[str, str | None]:
    """(the path to use, a problem or None) for the path `value` of config key `key`: a
    local one stays as it is (a model: a directory; a dataset: a file or a directory), a
    hub id becomes its cached snapshot."""
    local = Path(value) if base_dir is None or Path(value).is_absolute() else base_dir / value
    here = local.is_dir() if repo_type == "model" else local.exists()
    if not value or here or not HUB_ID.match(value):
        return value, None  # a local path (or not one: the path checks say so)
    snapshot = cached_snapshot(value, repo_type)
    if snapshot is None:
        what = "a directory" if repo_type == "model" else "a file, a directory"
        flag = "" if repo_type == "model" else " --repo-type dataset"
        return value, (f"{key}: {value!r} is neither {what} nor a {repo_type} in the local "
                       f"Hugging Face cache ({hub_cache()}); nothing is downloaded at run "
                       f"time: fetch it where there is network (huggingface-cli download"
                       f"{flag} {value}) into that cache (HF_HUB_CACHE), or give its path")
    return str(snapshot), None
