"""A user's trained reward model (a saved AutoModelForSequenceClassification) as the reward
of the text task: the same trajectory under Flattening, Interleaving and Separation at
max_staleness 0, PPO's critic started from it, and one clear error for each bad one."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer, GPT2Config, GPT2ForSequenceClassification

from rlhf_async import job
from rlhf_async.config import ConfigError, load_config
from rlhf_async.metrics import read_metrics
from rlhf_async.modeling.models import (
    ScalarHeadModel,
    load_scalar_model,
    sequence_inputs,
    sequence_scores,
)
from rlhf_async.task import make_task
from tests.text_model import make_text_model

pytestmark = [pytest.mark.timeout(300)]

PROMPTS = ["name a fruit .", "name a colour .", "list three animal .", "what is the sky ?",
           "give one fruit .", "name a big animal .", "what colour is the sea ?",
           "name a small animal .", "list three colour .", "is the sky blue ?"]


def make_reward_model(policy_dir, out, num_labels=1, vocab_extra=0):
    """A seeded GPT-2 sequence classifier on the policy's tokenizer, saved as HF saves it."""
    tok = AutoTokenizer.from_pretrained(policy_dir)
    cfg = GPT2Config(vocab_size=len(tok) + vocab_extra, n_positions=64, n_embd=32, n_layer=1,
                     n_head=2, num_labels=num_labels, pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(3)
        GPT2ForSequenceClassification(cfg).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("rm")
    (d / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    make_text_model(d / "model")
    make_reward_model(d / "model", d / "rm")
    return d


def _config(files, tmp_path, name, *overrides):
    return load_config(None, [
        f"model.path={json.dumps(str(files / 'model'))}", "task.name=text",
        f"task.prompts={json.dumps(str(files / 'prompts.jsonl'))}",
        f"reward_model.path={json.dumps(str(files / 'rm'))}",
        "generation.max_new_tokens=6", "task.max_prompt_tokens=32", "train.steps=2",
        "train.prompts_per_step=4", "algo.group_size=2", "algo.name=ppo",
        "algo.max_staleness=0", "run.eval_prompts=16", "run.plot=false",
        "run.progress=false", f"run.output_dir={json.dumps(str(tmp_path))}",
        f"run.name={name}", *overrides])


def test_a_saved_reward_model_gives_one_trajectory_under_every_strategy(files, tmp_path,
                                                                        one_thread):
    runs = {}
    for name, over in (("flat", []),
                       ("inter", ["placement.strategy=interleaving", "placement.devices=2"]),
                       ("sep", ["placement.strategy=separation", "placement.devices=2"])):
        summary = job.run(_config(files, tmp_path, name, *over))
        runs[name] = read_metrics(tmp_path / name / "metrics.jsonl")
        # no rule: the reported score is the reward model's, and so is the reward
        assert summary["final_reward"] == pytest.approx(summary["final_hidden_score"])
    for name in ("inter", "sep"):
        for a, b in zip(runs["flat"], runs[name], strict=True):
            for k in ("reward", "hidden_score", "policy_loss", "value_loss", "kl"):
                assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-5), (name, a["step"], k)
    # PPO's critic started from the reward model: its first values are the RM's scores
    assert runs["flat"][0]["value_loss"] > 0


def test_the_reward_is_the_classifiers_score_at_the_last_token(files):
    rm = load_scalar_model(files / "rm")
    assert isinstance(rm, ScalarHeadModel) and rm.head.bias is None  # its own `score` head
    hf = GPT2ForSequenceClassification.from_pretrained(files / "rm").eval()
    ids = torch.tensor([[5, 6, 7, 8, 1]])  # a response ending in EOS, no padding
    mask = torch.ones_like(ids)
    p_ids, p_mask, r_ids, r_mask = ids[:, :2], mask[:, :2], ids[:, 2:], mask[:, 2:]
    with torch.no_grad():
        ours = sequence_scores(rm.eval(), p_ids, p_mask, r_ids, r_mask)
        full, attn, _ = sequence_inputs(p_ids, p_mask, r_ids, r_mask)
        theirs = hf(input_ids=full, attention_mask=attn).logits[:, 0]
    torch.testing.assert_close(ours, theirs)


def test_bad_reward_models_are_one_clear_error_each(files, tmp_path):
    make_reward_model(files / "model", tmp_path / "two", num_labels=2)
    with pytest.raises(ConfigError, match="has num_labels = 2; a reward model gives one"):
        _config(files, tmp_path, "x", f"reward_model.path={json.dumps(str(tmp_path / 'two'))}")
    other = make_text_model(tmp_path / "other_tok", chat_template=True)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["banana"])  # another vocabulary
    make_reward_model(files / "model", tmp_path / "other")
    tok.save_pretrained(tmp_path / "other")
    cfg = _config(files, tmp_path, "x", f"reward_model.path={json.dumps(str(tmp_path / 'other'))}")
    with pytest.raises(ConfigError, match="has another tokenizer than model.path"):
        make_task(cfg)
    with pytest.raises(ConfigError, match="a trained reward model from a directory needs "
                                          "task.name"):
        load_config(None, [f"reward_model.path={json.dumps(str(files / 'rm'))}"])
    with pytest.raises(ConfigError, match="needs both"):
        _config(files, tmp_path, "x", "task.reward_weight=0.5")
    assert not (tmp_path / "x").exists()  # nothing written for a refused config


def test_critic_path_starts_ppos_critic_and_defaults_to_the_reward_model(files, tmp_path):
    from rlhf_async.task.artefacts import load_critic, prepare_artefacts

    make_reward_model(files / "model", tmp_path / "critic")
    with torch.random.fork_rng():  # another seed than the reward model's
        torch.manual_seed(9)
        hf = GPT2ForSequenceClassification.from_pretrained(tmp_path / "critic")
        torch.nn.init.normal_(hf.score.weight)
        hf.save_pretrained(tmp_path / "critic", safe_serialization=True)
    cfg = _config(files, tmp_path, "c", f"critic.path={json.dumps(str(tmp_path / 'critic'))}")
    art = prepare_artefacts(cfg, make_task(cfg))
    critic = load_critic(cfg, art)
    torch.testing.assert_close(critic.head.weight, hf.score.weight)
    default = load_critic(_config(files, tmp_path, "d"), art)  # the reward model's head
    torch.testing.assert_close(default.head.weight, load_scalar_model(files / "rm").head.weight)
    with pytest.raises(ConfigError, match="critic.path: grpo trains no critic"):
        _config(files, tmp_path, "x", f"critic.path={json.dumps(str(tmp_path / 'critic'))}",
                "algo.name=grpo")
