"""The calculator task (`rlhf_async/task/calculator.py`) as an agent on the `openai` client:
the policy may call a `calc` tool (an OpenAI function tool; the chat template's
`<tool_call>{json}</tool_call>` comes back as `tool_calls`), reads its result as a `tool`
message, and answers; an exact answer earns 1.

    rlhf-async run ... task.agent=examples/calculator_agent/agent.py:run

Each row is {"prompt": "What is 23*47?", "answer": "1081", "seed": ...} (prompts.jsonl's
columns). The chat is a system turn saying how to call the tool, one worked example (a
question, its call, the result, the answer) and the row's question: a small instruct model
(SmolLM2-135M) writes the call's JSON from the example, rarely from the description
alone. A call to another tool name, or with arguments `calc` cannot read, is answered
with what was wrong. The run records every token the policy generated here and trains on
them.
"""

from __future__ import annotations

import json
import re

import httpx
from openai import AsyncOpenAI

from rlhf_async.task.calculator import calc

SYSTEM = ("You can use a calculator. To call it, reply with exactly\n"
          '<tool_call>{"name": "calc", "arguments": {"expr": "12*34"}}</tool_call>\n'
          "and wait for its result. Then reply with the number only.")
EXAMPLE = [{"role": "user", "content": "What is 12*34?"},
           {"role": "assistant", "content":
            '<tool_call>{"name": "calc", "arguments": {"expr": "12*34"}}</tool_call>'},
           {"role": "tool", "content": "408"},
           {"role": "assistant", "content": "408"}]
TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "Evaluates an integer expression of + - *.",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}},
                   "required": ["expr"]}}}]
MAX_CALLS = 3  # task.max_turns: the endpoint refuses a call past it
# one HTTP client for every episode (agents share one event loop): a client per episode
# costs ~0.1 s of CPU each; the run's task.agent_timeout_s bounds an episode, not this
_HTTP: list[httpx.AsyncClient] = []


def client(base_url: str) -> AsyncOpenAI:
    if not _HTTP:
        _HTTP.append(httpx.AsyncClient(timeout=None, limits=httpx.Limits(
            max_connections=None)))
    return AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0,
                       http_client=_HTTP[0])


def tool_result(name: str, arguments: str) -> str:
    """The calc tool on a call's JSON arguments; what was wrong, for a call it cannot run
    ('?' for an expression `calc` does not evaluate)."""
    if name != "calc":
        return f"unknown tool {name!r}: the tool is calc"
    try:
        expr = json.loads(arguments).get("expr", "")
    except (json.JSONDecodeError, AttributeError):
        return "?"
    return calc(str(expr).replace(" ", ""))


async def run(base_url: str, row: dict) -> float:
    messages: list[dict] = [{"role": "system", "content": SYSTEM}, *EXAMPLE,
                            {"role": "user", "content": row["prompt"]}]
    policy = client(base_url)
    for _ in range(MAX_CALLS):
        reply = await policy.chat.completions.create(model="policy", messages=messages,
                                                     tools=TOOLS)
        message = reply.choices[0].message
        if not message.tool_calls:
            numbers = re.findall(r"-?\d+", message.content or "")
            return float(bool(numbers) and numbers[-1] == row["answer"])
        messages.append(message.model_dump(exclude_none=True))
        messages += [{"role": "tool", "tool_call_id": c.id,
                      "content": tool_result(c.function.name, c.function.arguments)}
                     for c in message.tool_calls]
    return 0.0  # no answer within MAX_CALLS calls
