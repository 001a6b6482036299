"""The calculator task (`rlhf_async/task/calculator.py`) as an agent on the `openai` client:
the policy may call a `calc` tool (an OpenAI function tool; the chat template's
`<tool_call>{json}</tool_call>` comes back as `tool_calls`), reads its result as a `tool`
message, and answers; an exact answer earns 1.

    rlhf-async run ... task.agent=examples/calculator_agent/agent.py:run

Each row is {"prompt": "What is 23*47?", "answer": "1081", "seed": ...} (prompts.jsonl's
columns). The run records every token the policy generated here and trains on them.
"""

from __future__ import annotations

import json
import re

from openai import AsyncOpenAI

from rlhf_async.task.calculator import calc

SYSTEM = ("You can use a calculator. To call it, reply with exactly\n"
          '<tool_call>{"name": "calc", "arguments": {"expr": "12*34"}}</tool_call>\n'
          "and wait for its result. Then reply with the number only.")
TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "Evaluates an integer expression of + - *.",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}},
                   "required": ["expr"]}}}]


def tool_result(arguments: str) -> str:
    """The calc tool on a call's JSON arguments ('?' for a call it cannot read)."""
    try:
        expr = json.loads(arguments).get("expr", "")
    except (json.JSONDecodeError, AttributeError):
        return "?"
    return calc(str(expr).replace(" ", ""))


async def run(base_url: str, row: dict) -> float:
    messages: list[dict] = [{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": row["prompt"]}]
    async with AsyncOpenAI(base_url=base_url, api_key="unused") as client:
        for _ in range(3):
            reply = await client.chat.completions.create(model="policy", messages=messages,
                                                         tools=TOOLS)
            message = reply.choices[0].message
            if not message.tool_calls:
                numbers = re.findall(r"-?\d+", message.content or "")
                return float(bool(numbers) and numbers[-1] == row["answer"])
            messages.append(message.model_dump(exclude_none=True))
            messages += [{"role": "tool", "tool_call_id": c.id,
                          "content": tool_result(c.function.arguments)}
                         for c in message.tool_calls]
    return 0.0  # no answer within three calls
