"""bench/ as one suite: every benchmark module is named in it, `python -m bench list` and
`run NAME` work and refuse what they cannot read, and every summary carries the same `meta`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import __main__ as suite_cli
from bench.output import write_json
from bench.suite import BENCHMARKS, HELPERS

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_every_benchmark_in_bench_is_in_the_suite():
    scripts = {p.name for p in BENCH.glob("*.py")} | {p.name for p in BENCH.glob("*.sh")}
    named = {b.script for b in BENCHMARKS.values()}
    assert named <= scripts, named - scripts
    assert scripts - HELPERS - named == set(), "add each new benchmark to bench/suite.py"
    readme = (BENCH / "README.md").read_text()
    for b in BENCHMARKS.values():
        assert f"## {b.section}" in readme or f"### {b.section}" in readme, b.name


def test_list_names_every_benchmark(capsys):
    assert suite_cli.main(["list"]) == 0
    out = capsys.readouterr().out
    for name, b in BENCHMARKS.items():
        assert f"{name} " in out and f"bench/{b.script}" in out


def test_run_starts_the_named_benchmark_with_its_own_args(monkeypatch):
    started = []
    monkeypatch.setattr(subprocess, "run",
                        lambda cmd: started.append(cmd) or subprocess.CompletedProcess(cmd, 3))
    assert suite_cli.main(["run", "longtail", "--quick", "train.steps=2"]) == 3
    assert suite_cli.main(["run", "gpu-check", "--dry-run"]) == 3
    assert started[0] == [sys.executable, "-m", "bench.longtail", "--quick", "train.steps=2"]
    assert started[1][0] == "bash" and started[1][1:] == [str(BENCH / "gpu_check.sh"),
                                                            "--dry-run"]


@pytest.mark.parametrize("argv", [["run", "nope"], ["--quick"], ["list", "x"], ["run"]])
def test_what_it_cannot_read_is_one_clear_error(argv, capsys):
    assert suite_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "python -m bench" in err and ("list" in err or "longtail" in err)


def test_every_summary_carries_the_same_meta(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(BENCH / "packing.py"), "--rounds", "1"])
    write_json(tmp_path / "s.json", {"rows": [1]})
    body = json.loads((tmp_path / "s.json").read_text())
    assert list(body) == ["meta", "rows"] and body["rows"] == [1]
    m = body["meta"]
    assert m["bench"] == "packing" and m["command"].endswith("packing.py --rounds 1")
    assert set(m) == {"bench", "command", "utc", "commit", "cores", "cpu", "loadavg", "python",
                      "torch"}
    assert len(m["loadavg"]) == 3 and m["cores"] >= 1


def test_the_module_runs_as_python_dash_m_bench():
    p = subprocess.run([sys.executable, "-m", "bench", "list"], cwd=BENCH.parent,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "strategies" in p.stdout and "eval-seeds" in p.stdout
