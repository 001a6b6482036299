"""The endpoint's HTTP connections under agents' `openai` clients: a pooled keep-alive
connection taken by a late request, and clients never closed."""

from __future__ import annotations

import asyncio

import httpcore
import httpx
import pytest
from openai import AsyncOpenAI

from rlhf_async.modeling.env_calls import env_loop
from rlhf_async.task.agents import endpoint as endpoint_module
from rlhf_async.task.agents.agent import agent_loop
from tests.agent_episodes import run_agent
from tests.chat_tokenizers import chatml_tokenizer

pytestmark = [pytest.mark.timeout(60)]


class _LateWrites(httpcore.AsyncNetworkBackend):
    """A network backend whose streams, once `late` is set, write `late` seconds after
    the request took its pooled connection: an agent's loop busy with other agents."""

    def __init__(self) -> None:
        self.inner, self.late, self.connects = httpcore.AnyIOBackend(), 0.0, 0

    async def connect_tcp(self, *args, **kwargs):
        self.connects += 1
        stream = await self.inner.connect_tcp(*args, **kwargs)
        backend = self

        class Late(httpcore.AsyncNetworkStream):
            async def write(self, buffer, timeout=None):
                if backend.late:
                    await asyncio.sleep(backend.late)
                    backend.late = 0.0
                await stream.write(buffer, timeout)

            def __getattr__(self, name):
                return getattr(stream, name)

        for name in ("read", "aclose", "start_tls", "get_extra_info"):
            setattr(Late, name, lambda self, *a, _n=name, **k: getattr(stream, _n)(*a, **k))
        return Late()


def test_a_pooled_connection_is_not_closed_under_a_request_on_its_way():
    """One keep-alive client shared by the agents: a request that takes a pooled
    connection and goes out 2.5 s later (its loop busy) is answered on that connection."""
    tok = chatml_tokenizer()
    backend = _LateWrites()
    transport = httpx.AsyncHTTPTransport()
    transport._pool._network_backend = backend  # the pool's connections: `backend`'s

    async def agent(base_url, row):
        async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0,
                               http_client=httpx.AsyncClient(transport=transport)) as c:
            msgs = [{"role": "user", "content": "six"}]
            await c.chat.completions.create(model="policy", messages=msgs)
            backend.late = 2.5
            r = await c.chat.completions.create(model="policy", messages=msgs)
            return float(r.choices[0].message.content == "six")

    (ep,), _, _ = run_agent(tok, agent, ["six", "six"])
    assert (ep.end, ep.reward, backend.connects) == ("done", 1.0, 1)


def test_clients_never_closed_leave_at_most_max_idle_connections(monkeypatch):
    monkeypatch.setattr(endpoint_module, "MAX_IDLE", 2)
    tok = chatml_tokenizer()
    leaked: list[AsyncOpenAI] = []

    async def agent(base_url, row):  # a client per episode, never closed
        leaked.append(AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0))
        await leaked[-1].chat.completions.create(model="policy", messages=[
            {"role": "user", "content": row["prompt"]}])
        return 1.0

    eps, _, _ = run_agent(tok, agent, ["six"], prompts=("six", "five", "four", "three"))
    assert [e.end for e in eps] == ["done"] * 4
    server = env_loop().run(endpoint_module.endpoint())
    assert len(server.idle.conns) == 2 and not any(c.is_closing() for c in server.idle.conns)
    assert server._runner is not None and len(server._runner.server.connections) == 2
    for client in leaked:
        asyncio.run_coroutine_threadsafe(client.close(), agent_loop()).result()


