"""An in-process chat harness: the task's prompt sent to the model through the rollout's
interception endpoint with the `openai` client (verifiers' `Harness.launch` contract: "a
harness may run its loop in-process ... as long as every model call goes through
`endpoint` + `secret`"). The built-in `null`/`bash` harnesses run a uv script instead,
which installs its packages at the first rollout; this one needs nothing at run time."""

from __future__ import annotations

from typing import Any

import verifiers.v1 as vf
from openai import AsyncOpenAI


class ChatHarnessConfig(vf.HarnessConfig):
    max_tokens: int | None = None
    """Cap on each reply's tokens (None = the endpoint's own)."""


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: vf.ModelContext, trace: vf.Trace, runtime: vf.Runtime,
                     endpoint: str, secret: str, mcp_urls: dict[str, str],
                     data: vf.TaskData) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] \
            if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages.extend(m.model_dump(exclude_none=True) for m in prompt or [])
        extra = {} if self.config.max_tokens is None else {"max_tokens": self.config.max_tokens}
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            reply = await client.chat.completions.create(model=ctx.model, messages=messages,
                                                         **extra)
        return vf.ProgramResult(exit_code=0, stdout=reply.choices[0].message.content or "",
                                stderr="")
