"""The registry: every strategy is a value behind its name, and adding one is one module
plus one registry line (here the toy `solo`, added with monkeypatch)."""

import json

import pytest

from rlhf_async.cli import main
from rlhf_async.config import load_config
from rlhf_async.job import run
from rlhf_async.planning.planner import choose, predictions, prepare_run
from rlhf_async.strategies import registry
from rlhf_async.strategies.placement import PlacementError
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
