"""The engines' registries are the one list of their names: the config takes any string, and
a name no registry holds is one clear error before anything runs (run, --dry-run, plan),
listing the accepted names, whatever is registered at the time. The chosen lines travel to
a job's processes as plain data."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlhf_async.cli import main
from rlhf_async.config import load_config
from rlhf_async.engines import (
    ENGINES,
    TRAINING_BACKENDS,
    Backend,
    Engine,
    adopt_engine_lines,
    engine_lines,
    engine_name_problems,
    make_training_backend,
)
from rlhf_async.planning.planner import plan_job, prepare_run
from rlhf_async.strategies.placement import PlacementError

UNKNOWN = ["generation.backend: unknown 'nope'; accepted: auto, torch, vllm, sim",
           "train.backend: unknown 'jax'; accepted: torch, deepspeed, sim"]


def test_an_unknown_engine_name_is_one_config_error_listing_the_accepted_ones(capsys):
    cfg = load_config(None, ["generation.backend=nope", "train.backend=jax"])  # any string
    with pytest.raises(PlacementError) as e:
        prepare_run(cfg)
    assert e.value.problems == UNKNOWN
    with pytest.raises(PlacementError) as e:  # a plan may be for another machine: no extras
        plan_job(cfg)
    assert e.value.problems[:2] == UNKNOWN
    assert main(["run", "--dry-run", "generation.backend=nope", "train.backend=jax",
                 "algo.policy_loss=zz"]) == 2
    err = capsys.readouterr().err
    assert all(p in err for p in UNKNOWN)
    assert "algo.policy_loss: unknown 'zz'" in err  # every registry's names, in one error


def test_a_registered_name_is_accepted_and_listed(monkeypatch):
    cfg = load_config(None, ["generation.backend=toy", "train.backend=toy"])
    assert len(engine_name_problems(cfg)) == 2
    monkeypatch.setitem(ENGINES, "toy", Engine("somewhere:Toy"))
    assert engine_name_problems(cfg) == ["train.backend: unknown 'toy'; accepted: torch, "
                                         "deepspeed, sim"]
    assert "accepted: auto, torch, vllm, sim, toy" in engine_name_problems(
        load_config(None, ["generation.backend=nope"]))[0]
    monkeypatch.setitem(TRAINING_BACKENDS, "toy", Backend("somewhere:Toy"))
    assert engine_name_problems(cfg) == []


class Plain:
    """A training backend's constructor that names no backend-specific setting."""

    def __init__(self, module: torch.nn.Module, *, lr: float, weight_decay: float,
                 grad_clip: float) -> None:
        self.module, self.lr = module, lr


def test_a_training_backend_is_imported_when_chosen_and_given_the_settings_it_names(
        monkeypatch):
    monkeypatch.setitem(TRAINING_BACKENDS, "plain", Backend(f"{__name__}:Plain"))
    lin = torch.nn.Linear(2, 2)
    got = make_training_backend("plain", lin, lr=0.5, weight_decay=0.0, grad_clip=1.0,
                                zero_stage=3, grad_accum=2)  # the learner passes every one
    assert isinstance(got, Plain) and got.module is lin and got.lr == 0.5
    with pytest.raises(ValueError, match="train.backend 'nope': accepted: torch, deepspeed, "
                       "sim, plain"):
        make_training_backend("nope", lin, lr=0.5, weight_decay=0.0, grad_clip=1.0)


def test_the_chosen_lines_reach_a_process_whose_registries_lack_them(monkeypatch):
    monkeypatch.setitem(ENGINES, "toy", Engine("somewhere:Toy", "toy_extra"))
    lines = engine_lines(load_config(None, ["generation.backend=toy"]))
    assert lines == {"generation": ["toy", dataclasses.asdict(ENGINES["toy"])],
                     "training": ["torch", dataclasses.asdict(TRAINING_BACKENDS["torch"])]}
    del ENGINES["toy"]  # a node process: the built-in lines only
    torch_line = TRAINING_BACKENDS["torch"]
    adopt_engine_lines({**lines, "training": ["torch", {"path": "elsewhere:X",
                                                        "extra": None}]})
    assert ENGINES["toy"] == Engine("somewhere:Toy", "toy_extra")
    assert TRAINING_BACKENDS["torch"] is torch_line  # a built-in line is never replaced
