"""The registry: every strategy is a value behind its name, and adding one is one module
plus one registry line (here the toy `solo`, added with monkeypatch); what a job asks of
its strategy (rebalance, partial rollouts, staleness, scale, resuming a checkpoint) is
asked of the strategy's fields, never of its name (the toy `relay` here)."""

import dataclasses
import json

import pytest

from rlhf_async.cli import main
from rlhf_async.config import ConfigError, PlacementConfig, load_config
from rlhf_async.config.presets import Recipe
from rlhf_async.control.reshape import ReshapeError, Scale
from rlhf_async.job import run
from rlhf_async.job.local import _check_strategy
from rlhf_async.planning.planner import choose, predictions, prepare_run
from rlhf_async.rl.checkpoint import Checkpoint, CheckpointError
from rlhf_async.runtime import run_loop
from rlhf_async.strategies import registry
from rlhf_async.strategies.base import Overrides, Strategy
from rlhf_async.strategies.placement import Placement, PlacementError
from rlhf_async.strategies.separation import strategy as separation
from tests.unit.strategies import toy_strategy


def test_every_registered_strategy_plans_and_names_its_roles():
    for name, strategy in registry.STRATEGIES.items():
        cfg = load_config(None, [f"placement.strategy={name}", "placement.devices=2"])
        p = registry.plan_placement(cfg.placement, cfg.algo.name)
        assert p.strategy == name and {q.role for q in p.processes} == set(strategy.roles)
        assert registry.runner_problems(cfg, p) == [], name
    with pytest.raises(PlacementError, match="'solo' is not a strategy; accepted: "
                       "flattening, interleaving, separation, auto"):
        registry.get("solo")


def test_a_toy_strategy_is_one_module_and_one_registry_line(tmp_path, monkeypatch):
    monkeypatch.setitem(registry.STRATEGIES, "solo", toy_strategy.STRATEGY)  # the line
    base = [f"run.cache_dir={json.dumps(str(tmp_path / 'cache'))}", "placement.strategy=solo",
            f"run.output_dir={json.dumps(str(tmp_path))}", "sft.steps=20",
            "reward_model.steps=20", "train.steps=2", "run.eval_prompts=16",
            "run.progress=false", "run.plot=false"]
    with pytest.raises(PlacementError, match="solo uses one device, got 2"):
        run(load_config(None, [*base, "placement.devices=2"]))
    s = run(load_config(None, [*base, "run.name=toy"]))
    assert s["strategy"] == "solo"
    lines = (tmp_path / "toy" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 1]
    assert (tmp_path / "toy" / "placement.txt").read_text().startswith("strategy solo on 1")
    assert (tmp_path / "toy" / "policy" / "model.safetensors").exists()


def test_the_toy_strategy_is_planned_and_priced_by_auto_from_its_module(monkeypatch, capsys):
    monkeypatch.setitem(registry.STRATEGIES, "solo", toy_strategy.STRATEGY)  # the same line
    one = load_config(None, ["placement.strategy=auto"])
    preds = predictions(one)
    # on one device solo and flattening hold the same four models on device 0 and both run
    # the phases in turn: the same price
    _, solo, priced, why = preds["solo"]
    assert solo is not None and priced is not None and why == ""
    assert priced.step_s == preds["flattening"][2].step_s
    assert priced.phases == preds["flattening"][2].phases
    assert "solo" in choose(one)[1]
    two = load_config(None, ["placement.strategy=auto", "placement.devices=2"])
    assert "solo not possible (placement.devices: solo uses one device, got 2)" in \
        choose(two)[1]
    # `plan` prints its placement and prediction; `plan --simulate` gives it a column
    assert main(["plan", "placement.strategy=solo"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("strategy solo on 1") and "predicted step" in out
    assert "  solo: " in out
    assert main(["plan", "--simulate", "--models", "7B", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "| solo s (GiB) |" in out and "solo vs flat" in out and "refused" in out
    # with nothing else registered, auto resolves to it and `run` would get its placement
    registered = dict(registry.STRATEGIES)
    registry.STRATEGIES.clear()
    registry.STRATEGIES["solo"] = toy_strategy.STRATEGY
    try:
        placement, reason = choose(one)
        assert placement.strategy == "solo" and reason.endswith("solo is the fastest feasible")
        cfg, placement = prepare_run(one)
        assert cfg.placement.strategy == placement.strategy == "solo"
    finally:  # in their order: the first is what `plan --simulate` compares the others to
        registry.STRATEGIES.clear()
        registry.STRATEGIES.update(registered)


def _relay(name: str, **does: bool) -> Strategy:
    """A toy strategy that runs its own processes, written in this file alone: Separation's
    trainer, generators and scorers under another name, doing what `does` says."""
    def preset(cfg: PlacementConfig, recipe: Recipe, over: Overrides) -> Placement:
        return dataclasses.replace(separation.preset(cfg, recipe, over), strategy=name)

    return Strategy(name=name, summary="separation's processes under another name",
                    roles=("trainer", "generator", "scorer"), preset=preset,
                    placement_problems=separation.placement_problems,
                    runner_problems=separation.runner_problems, run=separation.run,
                    pricing=separation.STRATEGY.pricing, **does)


FEATURES = ["placement.rebalance=true", "generation.partial_rollout=true",
            "algo.max_staleness=1"]


def _problems(overrides: list[str]) -> list[str]:
    try:
        prepare_run(load_config(None, overrides))
    except ConfigError as e:
        return e.problems
    return []


def test_what_a_job_asks_of_its_strategy_follows_the_strategys_fields_not_its_name(
        monkeypatch, tmp_path):
    monkeypatch.setitem(registry.STRATEGIES, "relay", _relay(
        "relay", scalable=True, rebalance=True, partial_rollout=True, staleness=True))
    monkeypatch.setitem(registry.STRATEGIES, "still", _relay("still"))
    monkeypatch.setitem(registry.STRATEGIES, "solo", toy_strategy.STRATEGY)
    two = ["placement.devices=2", *FEATURES]
    assert _problems(["placement.strategy=relay", *two]) == []
    assert _problems(["placement.strategy=separation", *two]) == []
    still = _problems(["placement.strategy=still", *two])
    assert [p.split(":")[0] for p in still] == ["placement.rebalance",
                                               "generation.partial_rollout",
                                               "algo.max_staleness"], still
    assert all("which only separation or relay does; placement.strategy = 'still' does not"
               in p for p in still), still
    solo = _problems(["placement.strategy=solo", "algo.max_staleness=2"])
    assert solo == [
        "algo.max_staleness: lets generation run up to 2 weight version(s) ahead of "
        "training, which only separation or relay does; placement.strategy = 'solo' "
        "generates and trains in turn (accepted: placement.strategy = separation or relay, "
        "or auto resolving to it; or algo.max_staleness = 0)"]
    # `scale` asks `scalable`: relay passes to the running-job check, still is refused
    assert registry.scale_refusal("relay") is None
    assert registry.scale_refusal("still") == ("scale changes a running separation or relay "
                                               "job only (still keeps its processes while it "
                                               "runs)")
    assert registry.scale_refusal("solo") == (
        "scale changes a running separation or relay job only (flattening, interleaving and "
        "solo hold every model in one process per device)")
    (tmp_path / "config.json").write_text(json.dumps({"placement": {"strategy": "relay"}}))
    with pytest.raises(ReshapeError, match="no running job"):
        run_loop(registry.request_scale(tmp_path, Scale(generators=2), timeout=5))
    # a checkpoint continues under a strategy of the family that wrote it
    ck = Checkpoint(tmp_path / "ckpt-00000002", 2, {}, {"strategy": "separation"})
    _check_strategy(ck, "relay")
    with pytest.raises(CheckpointError, match="this run has 'solo', which cannot continue"):
        _check_strategy(ck, "solo")


def test_max_staleness_under_a_lock_step_strategy_is_a_config_error(monkeypatch):
    for strategy in ("flattening", "interleaving"):
        problems = _problems([f"placement.strategy={strategy}", "placement.devices=2",
                              "algo.max_staleness=1"])
        assert [p for p in problems if p.startswith("algo.max_staleness:")] == [
            f"algo.max_staleness: lets generation run up to 1 weight version(s) ahead of "
            f"training, which only separation does; placement.strategy = {strategy!r} "
            "generates and trains in turn (accepted: placement.strategy = separation, or "
            "auto resolving to it; or algo.max_staleness = 0)"], problems
    # auto: accepted where it resolves to separation, refused where it chose a lock-step one
    assert _problems(["placement.strategy=auto", "algo.max_staleness=1"]) == []
    chosen = _problems(["placement.strategy=auto", "algo.max_staleness=1",
                        "placement.devices=4"])
    assert chosen == [
        "algo.max_staleness: placement.strategy = auto chose 'interleaving', which generates "
        "and trains in turn; it lets generation run up to 1 weight version(s) ahead of "
        "training under separation only; set placement.strategy = separation (or "
        "algo.max_staleness = 0)"], chosen
