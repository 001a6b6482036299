"""A local Hugging Face cache laid out as huggingface_hub writes it
(<kind>s--org--name/refs/main -> snapshots/<commit>/), for hub-id tests; nothing is
downloaded."""

from __future__ import annotations

from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_snapshot(cache: Path, kind: str, repo_id: str) -> Path:
    """The (empty) snapshot directory of `repo_id` (kind: model | dataset) in `cache`."""
    repo = cache / f"{kind}s--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snap
