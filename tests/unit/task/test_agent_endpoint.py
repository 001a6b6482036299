"""Agents through the OpenAI-compatible endpoint (`task.agent`): the `openai` client over
HTTP, a scripted policy turn in place of a model, and what each episode records."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from openai import BadRequestError
from structlog.testing import capture_logs

from bench.agent_endpoint import Setup
from rlhf_async.modeling.episodes import ENDS, Episode, episode_batch
from rlhf_async.modeling.rollout import ENV, POLICY
from rlhf_async.task.agents.agent_session import parse_tool_calls
from rlhf_async.task.sources.tokens import encode_prompt
from tests.agent_episodes import closing, run_agent
from tests.chat_tokenizers import chatml_tokenizer, llama3_tokenizer

pytestmark = [pytest.mark.timeout(60)]
TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "evaluates arithmetic",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}]
CALL = '<tool_call>\n{"name": "calc", "arguments": {"expr": "2+3"}}\n</tool_call>'


def _whole(tok, messages, tools=None) -> list[int]:
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False)
    return list(tok(text, add_special_tokens=False).input_ids)


def _assert_records_the_conversation(tok, ep: Episode, messages, tools=None):
    """The episode's tokens are the template's tokens of the whole conversation (up to
    the whitespace the template puts after the last turn's end token)."""
    got, whole = ep.prompt + ep.tokens, _whole(tok, messages, tools)
    assert got == whole[:len(got)]
    assert tok.decode(whole[len(got):]).strip() == ""


@pytest.mark.parametrize("make", [chatml_tokenizer, llama3_tokenizer])
def test_a_three_turn_chat_records_exactly_the_templates_tokens(make):
    tok = make()
    replies = ["the answer is five", "it is twenty four", "six"]
    final: list = []

    @closing
    async def agent(client, row):
        msgs = [{"role": "system", "content": "you are a helpful assistant ."},
                {"role": "user", "content": "what is two plus three"}]
        for q in ["and what about four times six", "thanks , one more : seven minus one", None]:
            r = await client.chat.completions.create(model="policy", messages=msgs)
            msgs.append({"role": "assistant", "content": r.choices[0].message.content})
            if q:
                msgs.append({"role": "user", "content": q})
        final.extend(msgs)
        return 1.0

    (ep,), _, calls = run_agent(tok, agent, replies)
    assert [m["content"] for m in final if m["role"] == "assistant"] == replies
    assert ep.end == "done" and ep.reward == 1.0 and ep.segments == 1 and calls == [
        (0, 0), (1, 0), (2, 0)]
    _assert_records_the_conversation(tok, ep, final)
    policy = [t for t, k in zip(ep.tokens, ep.kinds, strict=True) if k == POLICY]
    want = [t for r in replies for t in [*tok(r, add_special_tokens=False).input_ids,
                                         tok.eos_token_id]]
    assert policy == want
    assert [lp for lp, k in zip(ep.logprobs, ep.kinds, strict=True) if k == POLICY] == \
        [-0.5] * len(want)
    assert all(lp == 0.0 for lp, k in zip(ep.logprobs, ep.kinds, strict=True) if k == ENV)


def test_an_agent_that_rewrites_its_history_opens_a_new_segment_counted():
    tok = chatml_tokenizer()
    final: list = []

    @closing
    async def agent(client, row):
        msgs = [{"role": "user", "content": "what is two plus three"}]
        r = await client.chat.completions.create(model="policy", messages=msgs)
        # a summarising agent: the first question and answer replaced by a summary
        msgs = [{"role": "user", "content": "the answer is five . what about four times six"}]
        r = await client.chat.completions.create(model="policy", messages=msgs)
        final.extend([*msgs, {"role": "assistant", "content": r.choices[0].message.content}])
        return 0.5

    replies = ["the answer is five", "it is twenty four"]
    (ep,), batch, _ = run_agent(tok, agent, replies)
    assert ep.segments == 2 and ep.end == "done" and len(ep.earlier) == 1
    _assert_records_the_conversation(tok, ep, final)  # the row is the last segment
    b = episode_batch(batch, [ep], 400, tok.pad_token_id, 0, 0)
    # both segments trained, each once: the episode's row, then the earlier segment's
    assert b.episode_segments is not None and b.episode_segments.tolist() == [2, 0]
    assert b.sample_ids.tolist() == [0, 0] and b.env_rewards.tolist() == [0.5, 0.5]
    for i, (seg, reply) in enumerate(zip([ep, ep.earlier[0]], [replies[1], replies[0]],
                                         strict=True)):
        row = b.prompt_ids[i][b.prompt_mask[i].bool()].tolist() + \
            b.response_ids[i][b.response_mask[i] > 0].tolist()
        assert row == seg.prompt + seg.tokens
        trained = b.response_ids[i][b.loss_mask[i] > 0].tolist()
        assert trained == [*tok(reply, add_special_tokens=False).input_ids, tok.eos_token_id]
    assert b.select(b.episode_index()).episode_segments.tolist() == [2]


def test_a_tool_call_round_trips_through_the_template():
    tok = chatml_tokenizer()
    final: list = []
    seen: list = []

    @closing
    async def agent(client, row):
        msgs = [{"role": "user", "content": "what is two plus three"}]
        r = await client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
        m = r.choices[0].message
        seen.append((r.choices[0].finish_reason, m.tool_calls))
        msgs.append(m.model_dump(exclude_none=True))
        call = m.tool_calls[0]
        result = str(eval(json.loads(call.function.arguments)["expr"]))
        msgs.append({"role": "tool", "tool_call_id": call.id, "content": result})
        r = await client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
        msgs.append({"role": "assistant", "content": r.choices[0].message.content})
        final.extend(msgs)
        return 1.0

    (ep,), _, _ = run_agent(tok, agent, [CALL, "the answer is five"])
    finish, calls = seen[0]
    assert finish == "tool_calls" and len(calls) == 1
    assert calls[0].function.name == "calc"
    assert json.loads(calls[0].function.arguments) == {"expr": "2+3"}
    assert ep.segments == 1
    whole = [{**m, "tool_calls": [{"type": "function", "function": {
        "name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
        for c in m.get("tool_calls", [])]} if m.get("tool_calls") else m for m in final]
    _assert_records_the_conversation(tok, ep, whole, TOOLS)
    tool_turn = tok.decode([t for t, k in zip(ep.tokens, ep.kinds, strict=True) if k == ENV])
    assert "<tool_response>\n5\n</tool_response>" in tool_turn


def test_tool_call_blocks_that_are_not_calls_stay_text():
    assert parse_tool_calls("hi " + CALL) == ("hi", [{"type": "function", "function": {
        "name": "calc", "arguments": '{"expr": "2+3"}'}}])
    assert parse_tool_calls("<tool_call>not json</tool_call>") == \
        ("<tool_call>not json</tool_call>", [])


def test_failing_agents_fail_their_episodes_and_the_others_go_on():
    tok = chatml_tokenizer()

    @closing
    async def agent(client, row):
        kind = row["prompt"]
        if kind == "six":
            raise ValueError("my agent's bug")
        if kind == "the answer is five":
            await asyncio.sleep(30)  # hangs past task.agent_timeout_s
        if kind == "it is twenty four":
            return 1.0  # never calls the policy
        r = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": kind}])
        return {"reward": 2.0, "answer": r.choices[0].message.content}

    prompts = ("six", "the answer is five", "it is twenty four", "what is two plus three")
    with capture_logs() as logs:
        eps, batch, _ = run_agent(tok, agent, ["six"], prompts=prompts, timeout_s=1.0,
                             name="failing.py:run")
    errors = {e["event"]: str(e.get("error")) for e in logs}
    line = agent.__wrapped__.__code__.co_firstlineno + 4  # the raise (after a decorator)
    assert errors["agent episode failed"] == \
        f"run() raised ValueError: my agent's bug (at {__file__}:{line})"
    assert errors["agent episode failed without raising"].startswith(
        "returned without calling the policy")
    assert any(e["event"].startswith("agent episode timed out") for e in logs)
    assert [e.end for e in eps] == ["failed", "timeout", "failed", "done"]
    assert [e.reward for e in eps] == [0.0, 0.0, 0.0, 2.0]
    assert all(e.tokens == [] for e in eps[:3]) and eps[3].tokens
    b = episode_batch(batch, eps, 400, tok.pad_token_id, 0, 0)
    assert torch.equal(b.prompt_ids, batch.prompt_ids)  # failed rows keep their prompt


def test_unserved_requests_are_clear_400s():
    tok = chatml_tokenizer()
    errors: list[str] = []

    @closing
    async def agent(client, row):
        msgs = [{"role": "user", "content": "six"}]
        for kwargs in ({"stream": True}, {"n": 2}, {"messages": [{"role": "robot"}]}):
            try:
                await client.chat.completions.create(**{"model": "policy",
                                                        "messages": msgs, **kwargs})
            except BadRequestError as e:
                errors.append(str(e))
        models = await client.models.list()
        r = await client.completions.create(model="policy", prompt="what is two")
        return float(len(models.data) + len(r.choices))

    (ep,), _, _ = run_agent(tok, agent, ["six"])
    assert ep.reward == 2.0 and ep.end == "done"
    assert "streaming is not served" in errors[0] and "one choice" in errors[1]
    assert "role one of system" in errors[2]


def test_completions_continue_text_and_token_ids_without_retokenising():
    tok = chatml_tokenizer()
    seen: list = []

    @closing
    async def agent(client, row):
        r = await client.completions.create(model="policy", prompt="what is two")
        text = "what is two" + r.choices[0].text + " plus three"
        r = await client.completions.create(model="policy", prompt=text)
        seen.append(text + r.choices[0].text)
        ids = list(tok("six", add_special_tokens=False).input_ids)
        await client.completions.create(model="policy", prompt=ids)  # another history
        return 1.0

    (ep,), _, calls = run_agent(tok, agent, [" is", " five", "six"])
    assert ep.segments == 2 and [k for k, _ in calls] == [0, 1, 2]
    assert seen == ["what is two is plus three five"]
    six = list(tok("six", add_special_tokens=False).input_ids)
    assert ep.prompt + ep.tokens == [*six, *six, tok.eos_token_id]


def test_an_agent_records_the_same_tokens_as_the_environment_episode():
    """The same conversation as a `task.env` episode and as an agent's calls, sampled by a
    real (tiny) model with the same keys: the same token ids, turn by turn."""
    s = Setup(4)
    env, agent = s.run("env"), s.run("agent")
    assert env.episode_ends is not None and set(env.episode_ends.tolist()) == {ENDS.index("done")}
    assert int((env.response_mask == POLICY).sum()) > 3 * 4  # three turns of real tokens
    assert torch.equal(env.response_ids, agent.response_ids)
    assert torch.equal(env.response_mask, agent.response_mask)
    assert torch.allclose(env.behaviour_logprobs, agent.behaviour_logprobs)


def test_a_failing_generation_stops_the_run_rather_than_failing_the_agents():
    tok = chatml_tokenizer()

    @closing
    async def agent(client, row):
        await client.chat.completions.create(model="policy", messages=[
            {"role": "user", "content": "six"}])
        return 1.0

    with pytest.raises(IndexError):  # the scripted policy has no reply: the engine's error
        run_agent(tok, agent, [])


def test_an_agents_prompt_past_the_batch_width_is_named_once_with_its_room():
    """An agent renders its own prompt (a system turn, examples): what does not fit the
    batch's prompt width is context in the response, counted in the episode's tokens, so
    the run says so once, naming task.max_prompt_tokens and the width that would hold it."""
    tok = chatml_tokenizer()
    system = {"role": "system", "content": "you answer questions about numbers . " * 6}

    @closing
    async def agent(client, row):
        msgs = [system, {"role": "user", "content": row["prompt"]}]
        await client.chat.completions.create(model="policy", messages=msgs)
        return 1.0

    prompts = ("what is two plus three", "what is four times six")
    rendered = [len(encode_prompt(tok, [system, {"role": "user", "content": p}], True))
                for p in prompts]
    with capture_logs() as logs:
        eps, batch, _ = run_agent(tok, agent, ["five"], prompts=prompts, name="long.py:run")
        roomy, _, _ = run_agent(tok, agent, ["five"], prompts=prompts, width=max(rendered))
    width = batch.prompt_ids.shape[1]
    over = [e for e in logs if e["event"] == "agent prompt over task.max_prompt_tokens"]
    assert len(over) == 1 and over[0]["env"] == "long.py:run"
    assert over[0]["prompt_tokens"] == rendered[0] and over[0]["width"] == width
    assert eps[0].kinds[:rendered[0] - width] == [ENV] * (rendered[0] - width)
    assert all(len(e.prompt) == r and e.kinds[0] == POLICY
               for e, r in zip(roomy, rendered, strict=True))


def test_messages_past_the_episodes_tokens_are_answered_length_never_recorded():
    """A tool result (or a prompt) that leaves no room in generation.max_episode_tokens
    ends the episode as truncated, as an environment's observation does: the call is
    answered `length` with nothing, and the row still fits its batch."""
    tok = chatml_tokenizer()
    seen: list = []

    @closing
    async def agent(client, row):
        msgs = [{"role": "user", "content": row["prompt"]}]
        r = await client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
        m = r.choices[0].message
        msgs += [m.model_dump(exclude_none=True), {"role": "tool", "tool_call_id":
                                                   m.tool_calls[0].id, "content": "5 " * 40}]
        for _ in range(2):  # the second call finds the episode as full as the first
            r = await client.chat.completions.create(model="policy", messages=msgs,
                                                     tools=TOOLS)
            seen.append((r.choices[0].finish_reason, r.choices[0].message.content))
            msgs.append({"role": "assistant", "content": r.choices[0].message.content})
            msgs.append({"role": "user", "content": "and now ?"})
        return 0.0

    # the prompt with its tools fits the width; the call fits the 64 tokens, its result not
    (ep,), batch, calls = run_agent(tok, agent, [CALL, "five"], width=140, max_tokens=64)
    assert seen == [("length", ""), ("length", "")] and calls == [(0, 0)]
    assert ep.end == "truncated" and ep.kinds == [POLICY] * len(ep.tokens)
    b = episode_batch(batch, [ep], 64, tok.pad_token_id, 0, 0)
    assert b.loss_mask.sum() == len(ep.tokens) == len(tok(CALL).input_ids) + 1
