"""What an agent's request may ask of the sampler (`agent_session.py`): the run's
sampling or none; `stop` and `max_tokens` cut the reply, the record keeps the sampled
prefix with its log-probs."""

from __future__ import annotations

import pytest
from openai import BadRequestError

from rlhf_async.modeling.rollout import POLICY
from tests.agent_episodes import closing, run_agent
from tests.chat_tokenizers import chatml_tokenizer

pytestmark = [pytest.mark.timeout(60)]


def test_a_request_for_another_sampler_is_refused_naming_the_runs():
    tok = chatml_tokenizer()
    errors: list[str] = []

    @closing
    async def agent(client, row):
        msgs = [{"role": "user", "content": "six"}]
        for kwargs in ({"temperature": 0.7}, {"top_p": 0.9}, {"extra_body": {"top_k": 5}},
                       {"presence_penalty": 0.5}, {"logit_bias": {"5": 10}}, {"stop": 3}):
            try:
                await client.chat.completions.create(model="policy", messages=msgs, **kwargs)
            except BadRequestError as e:
                errors.append(e.body["message"])
        await client.chat.completions.create(model="policy", messages=msgs, temperature=1,
                                             top_p=1.0, seed=7, frequency_penalty=0)
        await client.completions.create(model="policy", prompt="six", temperature=1.0)
        try:
            await client.completions.create(model="policy", prompt="six", temperature=0)
        except BadRequestError as e:
            errors.append(e.body["message"])
        return 1.0

    (ep,), _, calls = run_agent(tok, agent, ["six", "six"])
    assert errors[0] == ("temperature: this run samples with generation.temperature = 1.0, "
                         "and trains on that sampler's log-probs; send temperature = 1.0 "
                         "or leave it out (got 0.7)")
    assert errors[1].startswith("top_p: this run samples with generation.top_p = 1.0")
    assert errors[2].startswith("top_k: this run samples with generation.top_k = 0")
    assert errors[3].startswith("presence_penalty: this run samples with 0.0 (not "
                                "configurable)")
    assert errors[4].startswith("logit_bias:")
    assert errors[5] == "stop: expected a string or a list of strings, got '3'"
    assert errors[6].startswith("temperature:") and len(errors) == 7
    # the refused requests neither reached the policy nor entered the record
    assert [k for k, _ in calls] == [0, 1] and ep.segments == 2 and ep.end == "done"


def test_stop_cuts_the_reply_and_the_record_keeps_the_sampled_prefix():
    tok = chatml_tokenizer()
    seen: list = []

    @closing
    async def agent(client, row):
        msgs = [{"role": "user", "content": "what is two plus three"}]
        r = await client.chat.completions.create(model="policy", messages=msgs,
                                                 stop=["nothing", "."])
        seen.append((r.choices[0].message.content, r.choices[0].finish_reason))
        msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                 {"role": "user", "content": "six"}]
        r = await client.chat.completions.create(model="policy", messages=msgs,
                                                 max_tokens=2)
        seen.append((r.choices[0].message.content, r.choices[0].finish_reason))
        return 1.0

    (ep,), _, _ = run_agent(tok, agent, ["the answer is five . and more", "it is six"])
    assert seen == [("the answer is five ", "stop"), ("it is", "length")]
    assert ep.segments == 1 and ep.end == "done"
    policy = [t for t, k in zip(ep.tokens, ep.kinds, strict=True) if k == POLICY]
    first = list(tok("the answer is five .", add_special_tokens=False).input_ids)
    assert policy == first + list(tok("it is", add_special_tokens=False).input_ids)
    assert [lp for lp, k in zip(ep.logprobs, ep.kinds, strict=True) if k == POLICY] == \
        [-0.5] * len(policy)
