"""End to end: SFT -> reward model -> RL through run_job / run, on CPU."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from rlhf_async.config import ConfigError, load_config
from rlhf_async.job import run, run_job
from rlhf_async.strategies.placement import PlacementError

SHORT = ["reward_model.steps=600", "train.steps=60", "run.progress=false"]
BF16 = 'placement.dtype=["actor=bf16","critic=bf16","reward=bf16","reference=bf16",' \
    '"shadow_actor=bf16"]'


@pytest.mark.parametrize("seed", [0, 2])
def test_default_recipe_improves_hidden_score_without_collapse(tmp_path, seed, cache):
    """The default recipe, shortened (half the reward-model steps, 60 RL steps), on two
    seeds of their own: better than SFT on held-out prompts, and no collapse after a peak."""
    cfg = load_config(None, [f"run.cache_dir={cache}", f"run.seed={seed}",
                             f"run.output_dir={tmp_path}", "run.name=short", *SHORT])
    s = run(cfg)
    assert s["final_hidden_score"] > s["sft_hidden_score"] + 0.08, s
    curve = [json.loads(x)["hidden_score"] for x in
             (tmp_path / "short" / "metrics.jsonl").read_text().splitlines()]
    peak = max(sum(curve[i - 5:i]) / 5 for i in range(5, len(curve) + 1))
    assert s["final_hidden_score"] > peak - 0.10, (s, peak)
    assert s["rm_accuracy"] > 0.75 and s["eval_prompts"] == 256 and len(curve) == 60
    assert (tmp_path / "short" / "metrics.png").exists()
    assert (tmp_path / "short" / "summary.json").exists()
    if seed == 0:  # a second run reuses the cached SFT and reward model
        s2 = run(load_config(None, [f"run.cache_dir={cache}", "run.plot=false",
                                    f"run.output_dir={tmp_path}", "run.name=again",
                                    "reward_model.steps=600", "train.steps=1",
                                    f"run.seed={seed}", "run.progress=false"]))
        assert s2["pretrain_seconds"] < 2.0 and s2["rm_accuracy"] == s["rm_accuracy"]


def test_bf16_separation_learns(tmp_path, cache):
    """Every model in bf16 under Separation on CPU (frozen reward and reference and the
    shadow actor held in bf16, actor and critic trained under bf16 autocast over fp32
    master weights), the shortened recipe of seed 0, cut to 30 RL steps (+0.16 there, on
    a 2-core box): it learns as fp32 does."""
    s = run(load_config(None, [f"run.cache_dir={cache}", "run.seed=0", "run.plot=false",
                               f"run.output_dir={tmp_path}", "run.name=bf16", *SHORT,
                               "train.steps=30",
                               "placement.strategy=separation", "placement.devices=2",
                               BF16]))
    assert s["final_hidden_score"] > s["sft_hidden_score"] + 0.08, s
    assert "bf16" in (tmp_path / "bf16" / "placement.txt").read_text()
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16" / "policy")
    assert {p.dtype for p in policy.parameters()} == {torch.float32}  # fp32 master weights


def test_user_hf_model_from_local_directory_trains(tmp_path, capsys):
    hf = LlamaConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    LlamaForCausalLM(hf).save_pretrained(tmp_path / "user_model")
    rc = run_job(None, [f"model.path={tmp_path / 'user_model'}", f"run.output_dir={tmp_path}",
                        f"run.cache_dir={tmp_path / 'cache'}", "run.name=user",
                        "sft.steps=30", "reward_model.steps=30", "train.steps=2",
                        "run.eval_prompts=16", "run.progress=false", "algo.name=grpo"])
    assert rc == 0 and "hidden score on 16 held-out prompts" in capsys.readouterr().out
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "user" / "policy")
    assert policy.config.model_type == "llama" and policy.config.vocab_size == 24
    start = LlamaForCausalLM.from_pretrained(tmp_path / "user_model")
    assert any(not torch.equal(a, b) for a, b in zip(start.parameters(), policy.parameters(), strict=False))


def test_config_errors_and_unknown_strategy(tmp_path):
    with pytest.raises(ConfigError) as ei:
        run_job(None, ["train.steps=0", "model.path=/nonexistent/dir", "algo.name=dpo"])
    assert len(ei.value.problems) == 3
    cfg = load_config(None, ["placement.strategy=bogus", f"run.output_dir={tmp_path}"])
    with pytest.raises(PlacementError, match="'bogus' cannot be placed directly; accepted: "
                       "flattening, interleaving, separation"):
        run(cfg)
    assert not any(tmp_path.iterdir())  # refused before anything was written
