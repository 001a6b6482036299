import pytest

from rlhf_async.config import PlacementConfig
from rlhf_async.placement import PlacementError, plan_placement


def test_separation_defaults_keep_training_apart():
    p = plan_placement(PlacementConfig(strategy="separation", devices=3, generators=2,
                                       scorers=2), "ppo")
    roles = {q.node_id: (q.role, q.devices, q.models) for q in p.processes}
    assert roles["trainer"] == ("trainer", (0,), ("actor", "critic"))
    assert roles["gen0"][1] == (1,) and roles["gen1"][1] == (2,)
    assert {roles["scorer0"][1], roles["scorer1"][1]} == {(1,), (2,)}
    assert "trainer" in p.table() and "cpu:0" in p.table()


def test_grpo_trains_no_critic_and_flattening_puts_everything_everywhere():
    p = plan_placement(PlacementConfig(strategy="separation", devices=2), "grpo")
    assert p.by_role("trainer")[0].models == ("actor",)
    f = plan_placement(PlacementConfig(strategy="flattening", devices=2), "ppo")
    assert [q.devices for q in f.processes] == [(0,), (1,)]
    assert all(q.models == ("actor", "critic", "reward", "reference") for q in f.processes)


def test_every_conflict_is_reported_at_once():
    cfg = PlacementConfig(strategy="separation", devices=2, actor=[0], generator=[0, 5],
                          reward=[1], reference=[0])
    with pytest.raises(PlacementError) as e:
        plan_placement(cfg, "ppo")
    text = str(e.value)
    assert "placement.generator: device ids [5]" in text
    assert "placement.reference" in text
    cfg = PlacementConfig(strategy="separation", devices=2, actor=[0], generator=[0])
    with pytest.raises(PlacementError, match="shares device"):
        plan_placement(cfg, "ppo")
