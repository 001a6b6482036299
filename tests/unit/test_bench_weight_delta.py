"""bench/bench_weight_delta.py end to end on a tiny text model: GRPO steps move the
weights, every codec and the gloo path deliver them bit-identical, the summary says so."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bench import bench_weight_delta
from tests.text_model import make_text_model

pytestmark = pytest.mark.timeout(120)


def test_delta_bench_on_a_tiny_model(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_text_model(tmp_path / "model")
    codec = Path(bench_weight_delta.delta.__file__)  # the codec as its own baseline
    monkeypatch.setattr(sys, "argv", ["bench", "--model", str(model), "--updates", "3",
                                      "--lr", "1e-2", "--baseline", str(codec)])
    bench_weight_delta.main()
    out = capsys.readouterr().out
    rows = [dict(kv.split("=", 1) for kv in line.split()) for line in out.splitlines()
            if line.startswith("version=")]
    assert [r["version"] for r in rows] == ["0", "1", "2"]
    assert rows[0]["full_mb"] == rows[0]["delta_mb"]  # the first update is full
    for r in rows[1:]:
        assert 0 < float(r["changed"]) <= 1  # the GRPO step moved the weights
        assert r["new_exact"] == r["old_exact"] == r["identical"] == "True"
        assert r["new_pct"] == r["old_pct"]
    assert "all bit-identical True" in out


def test_missing_model_is_one_clear_error(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["bench", "--model", str(tmp_path)])
    with pytest.raises(SystemExit, match="prepare-smollm2"):
        bench_weight_delta.main()
