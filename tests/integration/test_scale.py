"""Scaling a running Separation job (`rlhf-async scale`): one generator and one scorer, then
two of each, then one again (through the daemon's scale op), while the trainer goes on;
each step's prompts trained exactly once (counted from the trainer's log); the run
directory's config follows. Refusals: too few free devices (the job goes on), a Flattening
job, a run directory without a running job."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from rlhf_async.config import load_config
from rlhf_async.control.reshape import ReshapeError, Scale
from rlhf_async.ops.daemon.server import Daemon
from rlhf_async.runtime import run_loop
from rlhf_async.strategies.registry import request_scale
from rlhf_async.strategies.separation.rebalance import Work
from tests.faults import run_during, trained_counts

pytestmark = [pytest.mark.timeout(300)]

# trainer on 0, gen0 on 1, scorer0 on 2: devices 3 and 4 are free
TINY = ["model.hidden=32", "model.layers=1", "model.heads=2", "sft.steps=30",
        "reward_model.steps=30", "reward_model.heldout_pairs=64", "run.eval_prompts=16",
        "train.prompts_per_step=8", "algo.group_size=2", "run.plot=false",
        "run.progress=false", "placement.strategy=separation", "placement.devices=5",
        "placement.generator=[1]", "placement.reward=[2]", "algo.max_staleness=1",
        "run.checkpoint_every=2", "weight_sync.timeout_s=10"]


def _steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


async def _through_daemon(state: Path, run_dir: Path, request: dict) -> dict:
    """`request` (an op "scale") to a daemon whose job 1 is the run in `run_dir`, over its
    control socket."""
    daemon = Daemon(state)
    store = daemon.prepare()
    job = store.add("", "", [], daemon.paths.runs, daemon.paths.logs)
    store.update(job.id, state="running", run_dir=str(run_dir))
    server = await asyncio.start_unix_server(daemon._client, path=str(daemon.paths.socket))
    try:
        reader, writer = await asyncio.open_unix_connection(str(daemon.paths.socket))
        writer.write(json.dumps({**request, "id": job.id, "timeout": 60}).encode() + b"\n")
        reply = json.loads(await reader.readline())
        writer.close()
    finally:
        server.close()
        store.close()
    return reply


def _scale_at(run_dir: Path, plan: list[tuple[int, Any]], stop: threading.Event,
              done: list) -> None:
    """Send each scale once `step` steps are trained (a dict: through the daemon); what
    each answered (or the refusal) goes to `done`."""
    for step, scale in plan:
        while _steps(run_dir) < step or not (run_dir / "coordinator.json").exists():
            if stop.is_set():
                return
            time.sleep(0.05)
        t0 = time.monotonic()
        try:
            if isinstance(scale, dict):
                answer = run_loop(_through_daemon(run_dir.parent / "state", run_dir, scale))
            else:
                answer = run_loop(request_scale(run_dir, scale, timeout=60))
        except ReshapeError as e:
            answer = e
        done.append((_steps(run_dir), answer, time.monotonic() - t0))


def test_scale_up_and_down_mid_run_trains_each_prompt_once(tmp_path, cache):
    steps = 24
    cfg = load_config(None, [*TINY, f"run.cache_dir={json.dumps(str(cache))}",
                             f"run.output_dir={json.dumps(str(tmp_path))}", "run.name=scale",
                             f"train.steps={steps}"])
    run_dir, done = tmp_path / "scale", list[tuple]()
    plan = [(2, Scale(generators=2, scorers=2)), (5, Scale(generators=3)),
            (10, {"op": "scale", "generators": 1, "scorers": 1})]
    run_during(cfg, lambda stop: _scale_at(run_dir, plan, stop, done))
    assert len(done) == 3, done
    (_, up, _), (_, refused, _), (at_down, down, down_s) = done
    assert up.added == ["gen1", "scorer1"] and up.counts == {"generator": 2, "scorer": 2}
    assert isinstance(refused, ReshapeError) and "not enough free CPU slots" in str(refused)
    assert down["ok"], down
    assert down["result"]["removed"] == ["gen1", "scorer1"], down
    assert down["result"]["counts"] == {"generator": 1, "scorer": 1}
    assert at_down < steps, "scaled down only after the run ended"
    # gen1 left the weight-sync group before it stopped: no broadcast waited on it (a
    # broadcast to a gone peer would time out at weight_sync.timeout_s = 10)
    assert down_s < 8, down_s
    counts = trained_counts(run_dir)
    assert set(counts) == set(range(steps * 16)), "some prompts were never trained"
    assert set(counts.values()) == {1}, "some prompts were trained more than once"
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(steps))
    assert records[-1].get("faults/restarts", 0) == 0  # a retirement is no failure
    # the new nodes worked while they were there; the resolved placement followed
    for node in ("gen1", "scorer1"):
        assert any(r.get(f"util/{node}", 0) > 0 for r in records), node
        assert f"util/{node}" not in records[-1], node
    placement = json.loads((run_dir / "config.json").read_text())["placement"]
    assert placement["generators"] == 1 and placement["generator"] == [1]
    assert placement["scorers"] == 1 and placement["reward"] == [2]
    print("scale:", [(s, getattr(d, "counts", d), round(t, 2)) for s, d, t in done])


@pytest.mark.parametrize("strategy", ["flattening", "interleaving"])
@pytest.mark.parametrize("scale", [Scale(generators=2), Scale(generators=1, scorers=1)])
def test_scale_up_or_down_of_a_lockstep_job_is_refused(tmp_path, strategy, scale):
    run_dir = tmp_path / "flat"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"placement": {"strategy": strategy}}))
    with pytest.raises(ReshapeError) as e:
        run_loop(request_scale(run_dir, scale, timeout=5))
    assert str(e.value) == (
        f"{run_dir} runs placement.strategy = {strategy!r}: scale changes a running "
        "separation job only (flattening and interleaving hold every model in one process "
        "per device); to change its devices, stop it and resume it with another "
        "placement.devices")


def test_scale_of_a_run_dir_without_a_running_job_is_refused(tmp_path):
    with pytest.raises(ReshapeError, match="holds no job"):
        run_loop(request_scale(tmp_path, Scale(generators=2), timeout=5))
    (tmp_path / "config.json").write_text(json.dumps({"placement": {"strategy": "separation"}}))
    with pytest.raises(ReshapeError, match="no running job"):
        run_loop(request_scale(tmp_path, Scale(generators=2), timeout=5))


def test_rebalance_moves_a_scorer_device_to_the_generators_of_a_generation_bound_job(
        tmp_path, cache, monkeypatch):
    """Started with one generator and three scorers: a decision moves a scorer's device to a
    second generator; every prompt is still trained once and the decisions are in the step
    records. The stage times the decisions read are injected (a generation-bound profile):
    how fast this CPU runs each stage, idle or loaded, must not decide the verdict (the
    decision's arithmetic on recorded times is tests/unit/strategies/test_rebalance.py)."""
    windows: list[list[dict[str, Any]]] = []

    def generation_bound(records: list[dict[str, Any]], roles: dict[str, str]) -> Work:
        windows.append(records)
        return Work(generate=1.2, score=0.3, train=0.2)  # busy s per step, summed per stage

    monkeypatch.setattr(Work, "of", staticmethod(generation_bound))
    steps = 16
    cfg = load_config(None, [*TINY, f"run.cache_dir={json.dumps(str(cache))}",
                             f"run.output_dir={json.dumps(str(tmp_path))}", "run.name=rb",
                             f"train.steps={steps}", "placement.reward=[2,3,4]",
                             "placement.rebalance=true", "placement.rebalance_every=3",
                             "task.min_len=24", "task.short_len=32", "task.max_len=32",
                             "generation.max_new_tokens=40", "model.max_positions=96",
                             "run.checkpoint_every=0", 'placement.dtype=["shadow_actor=bf16"]'])
    run_during(cfg, lambda stop: None)
    run_dir = tmp_path / "rb"
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    decisions = [r for r in records if "rebalance/gain" in r]
    assert decisions, "no rebalancing decision was made"
    # the first move (a window measured on a loaded machine may fall short of the gain)
    moved = [r for r in decisions if r["rebalance/moved"] == 1]
    assert moved, [{k: round(v, 3) for k, v in r.items() if k.startswith("rebalance/")}
                   for r in decisions]
    first = moved[0]
    assert first["rebalance/generate_s"] == 1.2 and first["rebalance/score_s"] == 0.3, first
    assert first["rebalance/gain"] > 0.1 and first["rebalance/scorers"] == 3, first
    # each window the decisions priced was real step records with every node's busy share
    assert windows and all(any(k.startswith("util/") for k in r) for w in windows for r in w)
    placement = json.loads((run_dir / "config.json").read_text())["placement"]
    assert placement["generators"] >= 2 and placement["scorers"] <= 2, placement
    counts = trained_counts(run_dir)
    assert set(counts) == set(range(steps * 16)) and set(counts.values()) == {1}
    print("rebalance:", [{k: round(v, 3) for k, v in r.items() if k.startswith("rebalance/")}
                         for r in decisions])
