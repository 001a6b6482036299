"""Pipeline balance: `auto` sizes Separation's stages from predicted stage times, keeps
what the user pinned, and the run executes exactly the split the plan printed."""

import dataclasses

from rlhf_async.config import PlacementConfig, load_config
from rlhf_async.planning.costmodel import predict
from rlhf_async.planning.planner import (
    choose,
    machine,
    predictions,
    resolve_auto,
    shape_of,
    workload_of,
)
from rlhf_async.strategies.registry import runnable_placement
from rlhf_async.strategies.separation.pricing import split, splits

AUTO = ["placement.strategy=auto", "placement.device=cuda", "placement.devices=16",
        "algo.max_staleness=1", "algo.group_size=1"]
# a long generation on a small batch: generation is the step's longest stage
GEN_HEAVY = [*AUTO, "train.prompts_per_step=64", "generation.max_new_tokens=400", "generation.min_new_tokens=399",
             "task.max_len=6", "model.max_positions=512", "train.epochs=1",
             "train.minibatches=1"]
# a wider model, a large batch and 16 optimizer passes over it: training is (the
# gradients' all-reduce must not cost more than the ranks save)
TRAIN_HEAVY = [*AUTO, "train.prompts_per_step=1024", "generation.max_new_tokens=64",
               "model.max_positions=128", "model.hidden=1024", "model.layers=8",
               "model.heads=8", "train.epochs=4", "train.minibatches=4"]


def _sizes(placement):
    return {r: len(placement.by_role(r)) for r in ("trainer", "generator", "scorer")}


def test_every_split_uses_each_device_once():
    base = PlacementConfig(devices=7)
    for pc in splits(base):
        stages = pc.actor + pc.generator + (pc.reward if pc.reward != pc.actor else [])
        assert sorted(stages) == list(range(7)) and pc.actor and pc.generator
    assert split(base, 6, 1) is None  # no device left for a generator
    beside = split(base, 2, 0, beside_trainer=True)
    assert beside is not None and beside.reward == [0, 1] and beside.generator == [2, 3, 4, 5, 6]
    assert split(base, 2, 1, beside_trainer=True) is None  # beside the trainer or apart
    assert any(pc.reward == pc.actor for pc in splits(base))
    assert split(base, 3, 0, gen_tp=2) is not None and split(base, 3, 0, gen_tp=3) is None
    tp = split(dataclasses.replace(base, tensor_parallel=["actor=1", "shadow_actor=4"]), 3, 0,
               gen_tp=2)
    assert tp is not None and tp.tensor_parallel == ["actor=1", "shadow_actor=2"]


def test_auto_gives_the_longest_stage_the_most_devices():
    gen = _sizes(predictions(load_config(None, GEN_HEAVY))["separation"][1])
    train = _sizes(predictions(load_config(None, TRAIN_HEAVY))["separation"][1])
    assert gen["generator"] > train["generator"] and train["trainer"] > gen["trainer"]
    assert sum(gen.values()) >= 16


def test_the_balanced_split_is_predicted_no_slower_than_the_preset():
    for over in (GEN_HEAVY, TRAIN_HEAVY):
        cfg = load_config(None, over)
        dev, cal = machine(cfg)
        shape, work = shape_of(cfg), workload_of(cfg)
        _, balanced, pred, _ = predictions(cfg)["separation"]
        preset = runnable_placement(dataclasses.replace(cfg, placement=dataclasses.replace(
            cfg.placement, strategy="separation")))
        assert pred.step_s <= predict(preset, shape, work, dev, cal).step_s
        assert _sizes(balanced) != _sizes(preset)  # both configs are unbalanced as preset


def test_the_resolved_config_runs_the_split_auto_printed():
    cfg = load_config(None, GEN_HEAVY)
    placement, reason = choose(cfg)
    resolved = resolve_auto(cfg)
    assert resolved.placement.strategy == placement.strategy == "separation"
    assert "shadow_actor" in reason  # the split is in the reason
    again = runnable_placement(resolved)  # what `run` plans from the saved config
    assert again.processes == placement.processes and again.models == placement.models


def test_pinned_stage_sizes_are_kept():
    cfg = load_config(None, [*GEN_HEAVY, "placement.generator=[1,2]"])
    _, placement, _, _ = predictions(cfg)["separation"]
    assert _sizes(placement)["generator"] == 2 and _sizes(placement)["trainer"] == 1
    cfg = load_config(None, [*GEN_HEAVY, "placement.actor=[0,1,2,3]"])
    assert _sizes(predictions(cfg)["separation"][1])["trainer"] == 4
