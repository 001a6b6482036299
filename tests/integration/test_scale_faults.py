"""Scaling a running Separation job while something else happens to it: during a weight
broadcast (the trainer's send held by a generator that stops reading, as a slow link
would), and under chaos (random SIGKILLs of whichever nodes the job has while it scales
up and down). Each run is stopped a few steps after its last scale; every step it trained
is there once and every prompt of them trained exactly once."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from rlhf_async.config import load_config
from rlhf_async.control.chaos import kill_random
from rlhf_async.control.client import call_coordinator, read_coordinator_file
from rlhf_async.control.reshape import ReshapeError, Scale
from rlhf_async.metrics import read_metrics
from rlhf_async.runtime import run_loop
from rlhf_async.strategies.registry import request_scale
from tests.faults import run_during, steps_done, stop_job, trained_counts, wait_steps
from tests.integration.test_scale import TINY

pytestmark = [pytest.mark.timeout(300)]
MAX_STEPS = 400  # at most: each run is stopped once its faults are done


def _cfg(tmp_path: Path, cache: Path, name: str, *over: str) -> Any:
    return load_config(None, [*TINY, f"run.cache_dir={json.dumps(str(cache))}",
                              f"run.output_dir={json.dumps(str(tmp_path))}", f"run.name={name}",
                              f"train.steps={MAX_STEPS}", *over])


def _scale(run_dir: Path, scale: Scale) -> Any:
    try:
        return run_loop(request_scale(run_dir, scale, timeout=90))
    except ReshapeError as e:
        return e


def _pid(run_dir: Path, node: str) -> int:
    info = read_coordinator_file(run_dir)
    status = run_loop(call_coordinator(info["control"], "status", timeout=5,
                                       keys=info.get("keys")))
    return int(status["nodes"][node]["pid"])


def _exactly_once(run_dir: Path, summary: dict) -> list[dict]:
    records = read_metrics(run_dir / "metrics.jsonl")
    assert summary.get("stopped") and len(records) < MAX_STEPS, summary
    assert [r["step"] for r in records] == list(range(len(records)))
    counts = trained_counts(run_dir)
    assert set(counts) == set(range(len(records) * 16)), "some prompts were never trained"
    assert set(counts.values()) == {1}, "some prompts were trained more than once"
    return records


HOLD_S = 2.5  # how long gen0 stops reading: well under time_to_dead, so it is no death


def test_scale_up_and_down_during_a_weight_broadcast(tmp_path, cache):
    """gen0 is stopped (SIGSTOP) for HOLD_S while the trainer publishes: the broadcast to
    it cannot finish (its weights outgrow the socket buffers). Meanwhile the job scales up
    (gen1 joins the weight-sync group), later, again under a held broadcast, down (gen1
    leaves it). Both scales finish, nobody is declared dead, and the held broadcasts show
    in the step records' weight_sync_s."""
    # ~2.7 MB of fp32 weights a broadcast: more than loopback tcp buffers hold
    cfg = _cfg(tmp_path, cache, "bcast", "model.hidden=192", "model.layers=2",
               "runtime.time_to_dead=10", "weight_sync.timeout_s=30")
    run_dir, done = tmp_path / "bcast", list[Any]()

    def held_scale(scale: Scale) -> None:
        pid = _pid(run_dir, "gen0")
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            answer: list[Any] = []
            asking = threading.Thread(target=lambda: answer.append(_scale(run_dir, scale)))
            time.sleep(0.5)  # the trainer's next publish is under way, held by gen0
            asking.start()
            time.sleep(max(0.0, HOLD_S - (time.monotonic() - t0)))
        finally:
            os.kill(pid, signal.SIGCONT)
        asking.join()
        done.append(answer[0])

    def faults(stop: threading.Event) -> None:
        for scale in (Scale(generators=2, scorers=2), Scale(generators=1, scorers=1)):
            if not wait_steps(run_dir, steps_done(run_dir) + 3, stop):
                return
            held_scale(scale)
        if wait_steps(run_dir, steps_done(run_dir) + 3, stop):
            stop_job(run_dir)

    summary = run_during(cfg, faults)
    assert len(done) == 2, done
    up, down = done
    assert not isinstance(up, Exception) and up.added == ["gen1", "scorer1"], up
    assert not isinstance(down, Exception) and down.removed == ["gen1", "scorer1"], down
    records = _exactly_once(run_dir, summary)
    assert records[-1].get("faults/restarts", 0) == 0  # a held reader is no death
    held = [r["step"] for r in records if r.get("weight_sync_s", 0) >= 1.0]
    assert len(held) >= 2, [round(r.get("weight_sync_s", 0), 2) for r in records]
    assert any(r.get("util/gen1", 0) > 0 for r in records)


def test_chaos_while_scaling_up_and_down_trains_each_prompt_once(tmp_path, cache):
    """Random SIGKILLs (trainer, generators, scorers: whichever the job has then) every 2
    steps while the job scales 1 -> 2 -> 1 -> 2 -> 1 generators and scorers. A scale may be
    refused while a node it needs is down (one clear error, the job goes on); most go
    through; the job never loses or repeats a prompt."""
    cfg = _cfg(tmp_path, cache, "chaos", "run.checkpoint_every=1",
               "runtime.restart_limit=8", "runtime.time_to_dead=5")
    run_dir, victims, answers = tmp_path / "chaos", list[tuple[str, int]](), list[Any]()
    kills = 5

    def faults(stop: threading.Event) -> None:
        killer = threading.Thread(target=kill_random, args=(run_dir, kills, 2, stop, victims, 7))
        killer.start()
        try:
            for n in (2, 1, 2, 1):
                if not wait_steps(run_dir, steps_done(run_dir) + 2, stop):
                    return
                answers.append(_scale(run_dir, Scale(generators=n, scorers=n)))
            while len(victims) < kills and not stop.wait(0.1):
                pass
            if wait_steps(run_dir, steps_done(run_dir) + 2, stop):
                stop_job(run_dir)
        finally:
            killer.join()

    summary = run_during(cfg, faults)
    assert len(victims) == kills, victims
    assert len(answers) == 4, answers
    refused = [a for a in answers if isinstance(a, Exception)]
    assert all(isinstance(a, ReshapeError) for a in refused), refused
    assert len(refused) <= 2, answers
    records = _exactly_once(run_dir, summary)
    assert records[-1]["faults/restarts"] >= 1
    print("chaos while scaling:", victims, [getattr(a, "counts", a) for a in answers])
