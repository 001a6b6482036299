"""The calculator task: its tokens, its tool, its environment and its demonstrations."""

from __future__ import annotations

import asyncio

from rlhf_async.config import load_config
from rlhf_async.modeling.rollout import ENV, POLICY
from rlhf_async.task import make_task
from rlhf_async.task.calculator import CALL, CLOSE, EOS, CalculatorEnv, calc, decode, encode


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
