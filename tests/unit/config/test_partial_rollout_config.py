import importlib.util

import pytest

from rlhf_async.config import ConfigError, load_config
from rlhf_async.planning.planner import prepare_run


def test_partial_rollout_loads_from_a_cli_override():
    cfg = load_config(None, ["placement.strategy=separation", "generation.partial_rollout=true"])
    assert cfg.generation.partial_rollout is True
    assert load_config(None, []).generation.partial_rollout is False


@pytest.mark.parametrize(("overrides", "needle"), [
    (["placement.strategy=flattening"], "placement.strategy = 'flattening'"),
    (["placement.strategy=interleaving", "placement.devices=2"],
     "placement.strategy = 'interleaving'"),
    (["placement.strategy=separation", "task.name=calculator"], "multi-turn episodes"),
])
def test_partial_rollout_outside_separations_torch_engine_is_one_clear_error(overrides, needle):
    # whether the strategy does it is checked with its placement (what `run` and `--dry-run`
    # both check before anything starts); multi-turn episodes already when loading
    with pytest.raises(ConfigError) as ei:
        prepare_run(load_config(None, ["generation.partial_rollout=true", *overrides]))
    lines = [p for p in ei.value.problems if p.startswith("generation.partial_rollout:")]
    assert len(lines) == 1 and needle in lines[0], ei.value.problems


def test_partial_rollouts_and_episodes_are_refused_for_no_engine(monkeypatch):
    # what remains refused is the vllm extra missing, nothing of the rollout features
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    for over in (["generation.partial_rollout=true", "generation.continuous_batching=true"],
                 ["task.name=calculator"]):
        cfg = load_config(None, ["placement.strategy=separation", "generation.backend=vllm",
                                 *over])
        assert cfg.generation.backend == "vllm"


def test_auto_choosing_a_lock_step_strategy_refuses_partial_rollouts():
    cfg = load_config(None, ["placement.strategy=auto", "generation.partial_rollout=true"])
    with pytest.raises(ConfigError) as ei:
        prepare_run(cfg)  # one CPU device: auto chooses flattening
    assert any(p.startswith("generation.partial_rollout: placement.strategy = auto chose")
               for p in ei.value.problems), ei.value.problems


def test_continuous_batching_loads_and_needs_partial_rollouts():
    cfg = load_config(None, ["placement.strategy=separation", "generation.partial_rollout=true",
                             "generation.continuous_batching=true", "generation.batch_slots=48"])
    assert cfg.generation.continuous_batching and cfg.generation.batch_slots == 48
    with pytest.raises(ConfigError) as ei:
        load_config(None, ["placement.strategy=separation", "generation.continuous_batching=true"])
    assert any(p.startswith("generation.continuous_batching: needs generation.partial_rollout")
               for p in ei.value.problems), ei.value.problems
    with pytest.raises(ConfigError, match="generation.batch_slots"):
        load_config(None, ["generation.batch_slots=-1"])
