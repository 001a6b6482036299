"""bench/tinker_api.py at a tiny size: the real client through a `serve --api` process and
the same work done directly both run, and the summary says what it measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("tinker")

from bench import tinker_api


def test_the_tinker_api_bench_measures_both_paths(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    out = tmp_path / "tinker_api.json"
    assert tinker_api.main(["--rounds", "1", "--batch", "2", "--seq", "8", "--requests", "2",
                            "--samples", "2", "--max-tokens", "4", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    med = result["median"]
    assert all(med[k] > 0 for k in ("api_train", "direct_train", "api_tps", "direct_tps"))
    assert result["sample_ratio"] == pytest.approx(med["api_tps"] / med["direct_tps"])
    assert result["config"]["max_tokens"] == 4 and len(result["load_before"]) == 3
