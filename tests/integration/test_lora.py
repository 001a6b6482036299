"""LoRA end to end: Separation (one generator, fed the merged weights) follows the same
trajectory as Flattening (which generates with the adapted actor itself), and the final
policy is a plain merged model that `from_pretrained` loads."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlhf_async import job
from rlhf_async.config import load_config
from rlhf_async.metrics import read_metrics
from rlhf_async.task.artefacts import stage_key
from tests.policies import assert_same_policy

pytestmark = [pytest.mark.timeout(300)]

TINY = ["model.hidden=32", "model.layers=1", "model.heads=2", "sft.steps=30",
        "reward_model.steps=30", "reward_model.heldout_pairs=64", "run.eval_prompts=16",
        "train.steps=2", "train.prompts_per_step=8", "algo.group_size=2", "run.plot=false",
        "run.progress=false", "lora.rank=4", "lora.alpha=8", "train.lr=1e-2",
        "train.critic_lr=1e-2"]


def cfg_of(tmp_path, cache, name="x", *overrides):
    return load_config(None, [*TINY, f"run.cache_dir={json.dumps(str(cache))}",
                              f"run.output_dir={json.dumps(str(tmp_path))}",
                              f"run.name={name}", *overrides])


def _run(tmp_path, cache, name, *overrides):
    job.run(cfg_of(tmp_path, cache, name, *overrides))
    return read_metrics(tmp_path / name / "metrics.jsonl")


def test_separation_generator_gets_the_merged_weights(tmp_path, cache, one_thread):
    flat = _run(tmp_path, cache, "flat")
    sep = _run(tmp_path, cache, "sep", "placement.strategy=separation", "placement.devices=2",
               "algo.max_staleness=0")
    assert len(flat) == len(sep) == 2
    # step 1 samples from what the trainer broadcast: the same tokens (and so the
    # same rewards) as the adapted actor's own only if those were its merged weights
    for a, b in zip(flat, sep, strict=True):
        for k in ("reward", "kl", "policy_loss", "value_loss", "response_length"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-5), (a["step"], k)
    wf = load_file(str(tmp_path / "flat" / "policy" / "model.safetensors"))
    ws = load_file(str(tmp_path / "sep" / "policy" / "model.safetensors"))
    assert not any(".lora_" in k or "base_layer" in k for k in wf)
    assert_same_policy(wf, ws)
    # only the adapted layers moved away from the SFT model (embeddings, norms did not)
    sft = load_file(str(cache / stage_key(cfg_of(tmp_path, cache), "sft") / "model.safetensors"))
    moved = {k for k in sft if not torch.equal(sft[k], ws[k])}
    assert moved and all(k.endswith(".weight") and (".attn.c_" in k or ".mlp.c_" in k)
                         for k in moved), moved
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "sep" / "policy")
    assert policy.config.model_type == "gpt2"
