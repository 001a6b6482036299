"""The cluster in a box: Separation jobs on simulated GPUs (`placement.device = sim`) run
every node's real program (coordinator, driver, transport, staleness gate, weight-sync
group, restarts, scaling) at a size this machine could not run with real models: a
32-node job trains every prompt and step once; a job whose random nodes are SIGKILLed
finishes the same; a job scaled up and down mid-run loses nothing. Simulated time is
dilated (`sim.time_scale`), so no verdict here rests on how fast this machine is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_async import job
from rlhf_async.config import load_config
from rlhf_async.control.chaos import kill_random
from rlhf_async.control.reshape import Scale
from rlhf_async.metrics import read_metrics
from rlhf_async.runtime import run_loop
from rlhf_async.strategies.registry import request_scale
from tests.faults import run_during, trained_counts, wait_steps

pytestmark = [pytest.mark.timeout(240)]

# the stand-in real models: as small as the built-in task allows, barely trained (their
# quality is not what a twin measures)
TWIN = ["model.hidden=16", "model.layers=1", "model.heads=2", "sft.steps=1",
        "reward_model.steps=1", "reward_model.heldout_pairs=16", "run.eval_prompts=4",
        "run.plot=false", "run.progress=false", "algo.group_size=2",
        "placement.strategy=separation", "placement.device=sim", "train.backend=sim",
        "train.gradient_checkpointing=true", "runtime.node_start=fork", "sim.model=7B", "sim.time_scale=0.02"]


def _config(tmp_path: Path, cache: Path, name: str, *more: str):
    return load_config(None, [*TWIN, f"run.cache_dir={json.dumps(str(cache))}",
                              f"run.output_dir={json.dumps(str(tmp_path))}",
                              f"run.name={name}", *more])


def _exactly_once(run_dir: Path, steps: int, per_step: int) -> list[dict]:
    counts = trained_counts(run_dir)
    assert set(counts) == set(range(steps * per_step)), "some prompts were never trained"
    assert set(counts.values()) == {1}, "some prompts were trained more than once"
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(steps))
    return records


def test_a_32_node_twin_job_trains_every_prompt_and_step_once(tmp_path, cache):
    steps = 3
    cfg = _config(tmp_path, cache, "n32", f"train.steps={steps}", "train.prompts_per_step=48",
                  "placement.devices=32", "placement.actor=[0,1,2,3]",
                  f"placement.generator={list(range(4, 28))}", "placement.reward=[28,29,30,31]",
                  "algo.max_staleness=1")
    job.run(cfg)
    records = _exactly_once(tmp_path / "n32", steps, 96)
    gens = {k for r in records for k, v in r.items() if k.startswith("util/gen") and v > 0}
    assert len(gens) == 24, sorted(gens)  # every simulated GPU generated
    for r in records:  # simulated seconds, the real cost beside them
        assert r["time_step"] == pytest.approx(r["real/time_step"] / 0.02)
        assert r["control/real_s"] >= 0 and "control/share" in r


def test_a_twin_job_under_sigkills_of_random_nodes_trains_each_prompt_once(tmp_path, cache):
    steps, kills = 12, 4
    cfg = _config(tmp_path, cache, "chaos", f"train.steps={steps}",
                  "train.prompts_per_step=16", "placement.devices=12", "placement.gpu=H200",
                  "placement.actor=[0,1]", "placement.generator=[2,3,4,5,6,7,8,9]",
                  "placement.reward=[10,11]",
                  "algo.max_staleness=1", "run.checkpoint_every=1", "runtime.restart_limit=8",
                  "runtime.time_to_dead=5", "weight_sync.timeout_s=10")
    victims: list = []
    run_during(cfg, lambda stop: kill_random(tmp_path / "chaos", kills, 2, stop, victims,
                                             seed=3))
    assert len(victims) == kills, f"only {victims} were killed before the run ended"
    records = _exactly_once(tmp_path / "chaos", steps, 32)
    assert records[-1]["faults/restarts"] >= kills, victims


def test_a_twin_job_scales_up_and_down_without_losing_a_prompt(tmp_path, cache):
    steps = 14
    # trainer ranks on 0-1 (7B's states fit two H200s, ZeRO-3), generators on 2-5, scorers
    # on 6-7: devices 8-15 are free
    cfg = _config(tmp_path, cache, "scale", f"train.steps={steps}",
                  "train.prompts_per_step=16", "placement.devices=16", "placement.gpu=H200",
                  "placement.actor=[0,1]", "placement.generator=[2,3,4,5]",
                  "placement.reward=[6,7]",
                  "algo.max_staleness=1", "run.checkpoint_every=2",
                  "weight_sync.timeout_s=10")
    run_dir, answers = tmp_path / "scale", list[object]()

    def scale(stop) -> None:
        for at, ask in ((2, Scale(generators=8)), (8, Scale(generators=4))):
            if not wait_steps(run_dir, at, stop):
                return
            answers.append(run_loop(request_scale(run_dir, ask, timeout=60)))
    run_during(cfg, scale)
    assert len(answers) == 2, answers
    up, down = answers
    assert up.counts["generator"] == 8 and len(up.added) == 4  # type: ignore[attr-defined]
    assert down.counts["generator"] == 4 and len(down.removed) == 4  # type: ignore[attr-defined]
    records = _exactly_once(run_dir, steps, 32)
    # new generators took chunks (which ones is the driver's business) while they were there
    worked = {n for n in up.added for r in records if r.get(f"util/{n}", 0) > 0}  # type: ignore[attr-defined]
    assert worked, up.added  # type: ignore[attr-defined]
    assert records[-1].get("faults/restarts", 0) == 0  # a retirement is no failure


def test_a_twin_job_rebalances_from_a_bad_split_toward_its_bound_stage(tmp_path, cache):
    """One generator against three scorers, 8192-token responses: the generator's step is
    ~130 simulated s (2.6 s real), the trainer's ~17 plus the host's real overhead (under
    two CI runs, ~0.3 s real, 15 simulated s: with 2048 tokens, 17 s of generation against
    19 of training, and no move paid), so the first decision moves a scorer's device to a
    second generator (through the scale path: no restart, every prompt once) unless the
    trainer's real overhead passes ~2 s a step. A generator's busy time reaches the records
    with its chunks, one a step here: a window of n records holds n - 1 to n + 1 of them,
    so 4 (not 2, where one chunk of two made generation look no longer than training)."""
    steps = 8
    cfg = _config(tmp_path, cache, "rebalance", f"train.steps={steps}",
                  "train.prompts_per_step=8", "placement.devices=6", "placement.gpu=H200",
                  "placement.actor=[0,1]", "placement.generator=[2]",
                  "placement.reward=[3,4,5]", "algo.max_staleness=1",
                  "sim.prompt_tokens=256", "sim.response_tokens=8192",
                  "placement.rebalance=true", "placement.rebalance_every=4",
                  "weight_sync.timeout_s=10")
    job.run(cfg)
    records = _exactly_once(tmp_path / "rebalance", steps, 16)
    first = next(r for r in records if "rebalance/moved" in r)
    assert first["rebalance/moved"] == 1, first
    assert (first["rebalance/generators"], first["rebalance/scorers"]) == (1, 3)
    last = {k.removeprefix("util/") for k in records[-1] if k.startswith("util/")}
    assert {n for n in last if n.startswith("gen")} >= {"gen0", "gen1"}, last
    assert records[-1].get("faults/restarts", 0) == 0  # a move is no failure
