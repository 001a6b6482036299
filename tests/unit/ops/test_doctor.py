"""`rlhf-async doctor`, the Ray cluster's pre-flight, without a cluster: what one node's
report turns into (one line a problem, one ok line otherwise), a node's own report on this
machine, and the CLI's errors. On a Ray cluster: tests/integration/test_ray.py."""

from __future__ import annotations

import importlib.util
import json
import socket

import pytest

from rlhf_async.cli import main
from rlhf_async.ops import doctor

DIRS = {"run.output_dir": "/shared/runs", "run.cache_dir": "/shared/cache"}
GOOD = {"versions": doctor.versions(), "reach": "", "host": "node-b",
        "paths": {name: {"seen": True, "writable": True} for name in DIRS}}


def test_a_healthy_node_is_one_ok_line():
    found = doctor.node_findings("10.0.0.2", GOOD, doctor.versions(), DIRS, "10.0.0.1:5000")
    assert [f.line() for f in found] == [
        "ok    10.0.0.2: node-b: same versions, run.output_dir, run.cache_dir shared and "
        "writable, this host reachable"]


def test_each_problem_of_a_node_is_a_line_naming_it():
    bad = {**GOOD, "versions": {**GOOD["versions"], "torch": "2.0.0"},
           "paths": {"run.output_dir": {"seen": False, "writable": False},
                     "run.cache_dir": {"seen": True, "writable": False}},
           "reach": "Connection refused"}
    here = {**doctor.versions(), "torch": "2.13.0"}
    lines = [f.line() for f in doctor.node_findings("10.0.0.2", bad, here, DIRS, "10.0.0.1:5000")]
    assert lines == [
        "FAIL  10.0.0.2: versions differ from this host's: torch 2.0.0 there, 2.13.0 here",
        "FAIL  10.0.0.2: run.output_dir /shared/runs is not this host's directory there (no "
        "shared filesystem at that path); every node needs it at the same path",
        "FAIL  10.0.0.2: run.cache_dir /shared/cache is not writable there",
        "FAIL  10.0.0.2: cannot reach this host at 10.0.0.1:5000 over tcp (Connection "
        "refused); nodes must reach each other on any tcp port (firewall?)"]


def test_a_nodes_report_sees_markers_writes_and_connects(tmp_path):
    marker = tmp_path / "out" / ".marker"
    marker.parent.mkdir()
    marker.touch()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(4)
        port = s.getsockname()[1]
        report = doctor.node_report({"run.output_dir": str(marker),
                                     "run.cache_dir": str(tmp_path / "elsewhere" / ".m")},
                                    "127.0.0.1", port)
    assert report["paths"] == {"run.output_dir": {"seen": True, "writable": True},
                               "run.cache_dir": {"seen": False, "writable": False}}
    assert report["reach"] == "" and report["versions"] == doctor.versions()
    assert sorted(p.name for p in marker.parent.iterdir()) == [".marker"]  # its probe is gone
    closed = doctor.node_report({}, "127.0.0.1", port)["reach"]  # nothing listens there now
    assert "refused" in closed.lower()


def test_a_run_directory_is_checked_with_its_own_config_only(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"placement": {"devices": 2}}))
    assert main(["doctor", str(tmp_path), "train.steps=3"]) == 1
    assert capsys.readouterr().err.strip() == (
        f"rlhf-async doctor: error: {tmp_path} is a run directory: it is checked with its own "
        "config.json; give no key=value")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["doctor", str(empty)]) == 1
    assert "is not a run directory with a readable config.json" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("ray") is not None, reason="ray is installed")
def test_without_ray_the_doctor_names_the_extra(capsys):
    assert main(["doctor", "train.steps=3"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlhf-async doctor: error:") and "rlhf-async[ray]" in err, err
