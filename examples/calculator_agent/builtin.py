"""The built-in calculator task's episodes (`rlhf_async/task/calculator.py`) played by an
agent on the `openai` client:

    rlhf-async run task.name=calculator task.agent=examples/calculator_agent/builtin.py:run

The task keeps its SFT, its tokens and its held-out exact match; this agent replaces only
its episode loop. The row is {"prompt": "23*47", "answer": "1081", "seed": ...}; the chat
is the task's own format (its tokenizer's chat template): the question as the user turn,
the policy's `calc(23*47)` executed here and its result sent back as a tool turn, and the
policy's next reply judged, 1 for the exact answer. The tokens recorded are those the
in-process episode records for the same conversation.
"""

from __future__ import annotations

import httpx
from openai import AsyncOpenAI

from rlhf_async.task.calculator import calc

MAX_TURNS = 3  # task.max_turns: the endpoint refuses a call past it
# one HTTP client for every episode (agents run on one event loop): a new AsyncOpenAI with
# its own costs ~0.1 s of CPU, as much as a whole episode of the tiny model
_HTTP: list[httpx.AsyncClient] = []


def client(base_url: str) -> AsyncOpenAI:
    if not _HTTP:
        _HTTP.append(httpx.AsyncClient(timeout=60.0, limits=httpx.Limits(
            max_connections=None)))
    return AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0,
                       http_client=_HTTP[0])


async def run(base_url: str, row: dict) -> float:
    messages: list[dict] = [{"role": "user", "content": row["prompt"]}]
    policy = client(base_url)
    for _ in range(MAX_TURNS):
        reply = (await policy.chat.completions.create(model="policy",
                                                      messages=messages)).choices[0]
        text = reply.message.content or ""
        if reply.finish_reason != "stop":  # out of tokens mid-turn: no answer
            return 0.0
        if not (text.startswith("calc(") and text.endswith(")")):
            return float(text == row["answer"])
        messages += [{"role": "assistant", "content": text},
                     {"role": "tool", "content": calc(text[len("calc("):-1])}]
    return 0.0  # no answer within MAX_TURNS calls
