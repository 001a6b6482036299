"""bench.twin's layouts and the staleness gate's bound, without running a job."""

from __future__ import annotations

from bench.twin import BASE, _prompts, fitting_ranks, layout, predicted
from rlhf_async.config import load_config


def test_layouts_put_every_role_on_gpus_of_its_own_and_prompts_divide():
    assert [fitting_ranks(m) for m in ("7B", "13B", "33B", "65B")] == [4, 8, 32, 64]
    for n in (8, 16, 32, 64, 128):
        cfg = load_config(None, [*BASE, *layout(n, max(n // 8, 4))])
        p = cfg.placement
        devices = [*p.actor, *p.generator, *p.reward]
        assert sorted(devices) == list(range(n))
        assert cfg.train.prompts_per_step % len(p.actor) == 0
        assert cfg.train.prompts_per_step % len(p.generator) == 0
    assert layout(128, 16)[-1] == "train.prompts_per_step=192"  # 96 generators, two each
    assert _prompts(3, 4) == 12


def test_the_prediction_prices_the_staleness_gate():
    """With k = 0 every stage runs in turn (the gate's cycle is the whole step); with k = 1
    two steps overlap: the cost model's step (`pricing.gate_cycle` inside) is no longer."""
    args = [*BASE, *layout(8, 4), "sim.model=7B"]
    serial, overlapped = (predicted([*args, f"algo.max_staleness={k}"]) for k in (0, 1))
    assert serial > overlapped > 0


def test_the_prediction_prices_a_critic_only_where_the_algorithm_has_one():
    """PPO trains a critic beside the actor; GRPO (group baseline) has none: its step is
    shorter. The prediction priced a critic for every algorithm."""
    args = [*BASE, *layout(8, 4), "sim.model=7B"]
    ppo, grpo = (predicted([*args, f"algo.name={a}"]) for a in ("ppo", "grpo"))
    assert ppo > grpo > 0
