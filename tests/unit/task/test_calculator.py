"""The calculator task: its tokens, its tool, its environment and its demonstrations."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from rlhf_async.config import load_config
from rlhf_async.modeling.episodes import rollout
from rlhf_async.modeling.rollout import ENV, POLICY
from rlhf_async.task import make_task, sampling_params
from rlhf_async.task.artefacts import _new_actor, train_sft
from rlhf_async.task.calculator import (
    BOS,
    CALL,
    CLOSE,
    EOS,
    OBS,
    SEP,
    CalculatorEnv,
    CalculatorTokenizer,
    calc,
    decode,
    encode,
)

AGENT = str(Path(__file__).parents[3] / "examples/calculator_agent/builtin.py") + ":run"


def test_tokens_round_trip_and_the_tool():
    assert decode(encode("calc(12*34)")) == "calc(12*34)"
    assert encode("calc(1)")[0] == CALL and encode("calc(1)")[-1] == CLOSE
    assert calc("12*34") == "408" and calc("07+1") == "8"
    assert calc("__import__('os')") == "?" and calc("") == "?"


def test_environment_answers_calls_and_judges_the_answer():
    env = CalculatorEnv()
    asyncio.run(env.reset({"answer": "408", "seed": 0}))
    assert asyncio.run(env.step("calc(12*34)")) == ("408", 0.0, False)
    assert asyncio.run(env.step("408")) == ("", 1.0, True)
    assert asyncio.run(env.step("407"))[1:] == (0.0, True)


def test_demonstrations_mark_the_tool_output_as_environment_tokens():
    task = make_task(load_config(None, ["task.name=calculator"]))
    p_ids, _, r_ids, kinds = task.demonstrations(0, 0, 64)
    tool = [i for i in range(64) if int(r_ids[i, 0]) == CALL]
    assert 0 < len(tool) < 64  # some call the tool, the others answer at once
    for i in range(64):
        ks = [k for k in kinds[i].tolist() if k]
        toks = r_ids[i][kinds[i] > 0].tolist()
        assert toks[-1] == EOS and ks[-1] == POLICY
        assert (ENV in ks) == (i in tool)
    scores = task.hidden_scores(p_ids, r_ids, kinds)
    assert scores.tolist() == [1.0] * 64  # every demonstration answers exactly
    eval_ = task.prompt_batch(0, "eval", 0, 50, 1).prompt_ids.tolist()
    train = task.prompt_batch(0, "train", 0, 200, 1).prompt_ids.tolist()
    assert not {tuple(x) for x in eval_} & {tuple(x) for x in train}


def test_its_own_defaults_yield_to_the_users_keys():
    cfg = load_config(None, ["task.name=calculator"])
    assert cfg.train.steps == 20 and cfg.generation.max_episode_tokens == 20
    cfg = load_config(None, ["task.name=calculator", "train.steps=7"])
    assert cfg.train.steps == 7
    assert load_config(None, []).train.steps == 100  # other tasks keep the general ones


def test_the_agent_example_records_the_built_in_episodes_tokens(one_thread):
    """examples/calculator_agent/builtin.py through the endpoint and `CalculatorEnv` in
    process, sampled by the same SFT'd model with the same seeds: the same episodes,
    token for token (tool calls and their results included), rewards and ends."""
    tiny = ["task.name=calculator", "model.hidden=32", "model.layers=1", "model.heads=2",
            "sft.steps=30", "run.progress=false"]
    cfg = load_config(None, tiny)
    agent_cfg = load_config(None, [*tiny, f"task.agent={AGENT}"])
    task, agent_task = make_task(cfg), make_task(agent_cfg)
    actor = _new_actor(cfg, task)
    train_sft(task, actor, cfg)
    prompts = task.prompt_batch(0, "train", 0, 16, 2)
    with torch.no_grad():
        env = rollout(actor.eval(), prompts, sampling_params(cfg, task), 0, 0, 0)
        agent = rollout(actor, prompts, sampling_params(agent_cfg, agent_task), 0, 0, 0)
    calls = [i for i, r in enumerate(env.response_ids.tolist()) if r[0] == CALL and OBS in r]
    assert len(calls) >= 2  # tool calls answered by the tool, not only direct answers
    assert torch.equal(env.prompt_ids, agent.prompt_ids)
    assert torch.equal(env.response_ids, agent.response_ids)
    assert torch.equal(env.response_mask, agent.response_mask)
    # the same tokens: their log-probs to float rounding (turns batched differently)
    assert torch.allclose(env.behaviour_logprobs, agent.behaviour_logprobs, atol=1e-5)
    assert env.env_rewards.tolist() == agent.env_rewards.tolist()
    assert env.episode_ends.tolist() == agent.episode_ends.tolist()


def test_its_tokenizer_renders_the_episodes_format():
    tok = CalculatorTokenizer()
    chat = [{"role": "user", "content": "12*34"}, {"role": "assistant", "content": "calc(12*34)"},
            {"role": "tool", "content": "408"}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == "<s>12*34=calc(12*34)\n>408="
    assert tok(text, add_special_tokens=False).input_ids == [
        BOS, *encode("12*34"), SEP, *encode("calc(12*34)"), OBS, *encode("408"), SEP]
    with pytest.raises(Exception, match="no system turn"):
        tok.apply_chat_template([{"role": "system", "content": "hi"}], tokenize=False)
