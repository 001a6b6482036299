"""bench/tinker_api.py at a tiny size: the real client through a `serve --api` process and
the same work done directly both run, and the summary says what it measured."""

from __future__ import annotations

import json
import os
import sys
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
    assert result["sample_ratio_paired"] == pytest.approx(
        result["rounds"]["api_tps"][0] / result["rounds"]["direct_tps"][0])
    cpu = result["sample_cpu_ms_per_round"]
    if sys.platform == "linux":  # from /proc: each side's CPU time on the sample rounds
        assert set(cpu) == {"server_event_loop", "server_engine", "client", "direct"}
        assert all(v >= 0 for v in cpu.values())


def test_cpu_seconds_come_from_proc_for_a_process_and_its_threads() -> None:
    pid = os.getpid()
    whole = tinker_api.cpu_s(pid)
    if sys.platform != "linux":
        assert whole is None
        return
    assert whole is not None and whole > 0  # this process has imported torch
    main = tinker_api.cpu_s(pid, pid)
    assert main is not None and 0 < main <= whole + 0.02  # one thread's share of the whole
    assert tinker_api.cpu_s(pid, 2 ** 22 + 7) is None  # no such thread


def test_the_engine_share_is_never_negative_when_the_counters_are_read_a_tick_apart() -> None:
    counts = tinker_api.CpuCounts(os.getpid())
    # the loop took a tick between the reads of its counter and the process's: the process
    # counter moved by one tick less than the loop's own, with the engine idle
    before = {"loop": 1.00, "server": 2.00, "me": 5.0}
    api_done = {"loop": 1.02, "server": 2.01, "me": 5.1}
    counts.add(before, api_done, {**api_done, "me": 5.3})
    assert counts.per_round_ms() == pytest.approx(
        {"server_event_loop": 20.0, "server_engine": 0.0, "client": 100.0, "direct": 200.0})
