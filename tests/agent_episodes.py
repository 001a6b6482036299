"""Agent episodes for tests: an agent given an `openai` client on its episode's base URL,
run through the OpenAI-compatible endpoint (`task.agent`) with a scripted policy turn in
place of a model."""

from __future__ import annotations

import functools

import torch
from openai import AsyncOpenAI

from rlhf_async.modeling.env_calls import env_loop
from rlhf_async.modeling.environment import EpisodeSpec
from rlhf_async.modeling.episodes import play
from rlhf_async.modeling.generation import SamplingParams
from rlhf_async.modeling.rollout import PromptBatch
from rlhf_async.task.agents.agent import AgentEpisodes
from rlhf_async.task.agents.agent_session import NO_ENV
from rlhf_async.task.sources.tokens import encode_prompt


def closing(agent):
    """The agent given an `openai` client on its episode's base URL, closed after it (an
    unclosed client's sockets are left to the garbage collector)."""
    @functools.wraps(agent)
    async def run(base_url, row):
        async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
            return await agent(client, row)
    return run


def run_agent(tok, agent, replies, prompts=("what is two plus three",), timeout_s=20.0,
         width=None, name="agent.py:run", max_tokens=400):
    """Each row's episode; the policy answers turn k with replies[k] + its end token."""
    end = tok.eos_token_id
    rows = [encode_prompt(tok, p, True) for p in prompts]
    P = width or max(len(r) for r in rows)
    ids = torch.full((len(rows), P), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, P - len(r):], mask[i, P - len(r):] = torch.tensor(r), 1
    batch = PromptBatch(ids, mask, torch.arange(len(rows)), torch.arange(len(rows)))
    calls: list[tuple[int, int]] = []

    async def turn(k, eps, sids):
        calls.extend((k, s) for s in sids)
        out = []
        for _ in eps:
            toks = [*tok(replies[k], add_special_tokens=False).input_ids, end]
            out.append((toks, [-0.5] * len(toks), True))
        return out

    texts = {tuple(r): p for r, p in zip(rows, prompts, strict=True)}
    spec = EpisodeSpec(lambda: NO_ENV, lambda t: {"prompt": texts[tuple(t)]}, lambda _: [],
                       lambda t: tok.decode(t, skip_special_tokens=True), 5, max_tokens, timeout_s,
                       name, AgentEpisodes(agent, tok, True))
    params = SamplingParams(64, end, tok.pad_token_id, episode=spec)
    eps = env_loop().run(play(batch, params, spec, 0, 0, turn))
    return eps, batch, calls


