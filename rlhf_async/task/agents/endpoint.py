"""The OpenAI-compatible endpoint an agent's episodes talk to (`task.agent`).

One HTTP server per process, on 127.0.0.1 (a free port), started at the first agent
episode and serving on the process's environment loop (`env_loop`, where the episodes and
their policy turns run). Each episode is a session with its own base URL,
`http://127.0.0.1:PORT/s/<session>/v1`, serving

    GET  /models              the policy (any `model` name is accepted in requests)
    POST /chat/completions    messages (+ tools) -> the policy's reply (+ tool_calls)
    POST /completions         a text or token-id prompt -> its continuation

What a call records is in `agent_session.py`. Sampling is the run's (`generation.*`: the
behaviour log-probs trained on are that sampler's): a request asking for another
temperature, top_p, ... is answered 400 naming the run's; `max_tokens` and `stop` cut the
reply. Not served: `stream: true` and `n > 1` (answered 400, as is any malformed request,
with what is accepted).

Keep-alive: an idle connection stays open `KEEPALIVE_S`, longer than any common client
keeps one in its pool (httpx 5 s, aiohttp 15 s, Go 90 s), so a client always retires a
connection before the server closes it. A shorter limit races: a client checks a pooled
connection is open, yields to its loop (busy with other agents), and writes its request
after the server closed it; the request fails (`APIConnectionError`). An agent that never
closes its clients leaves a connection per episode: past `MAX_IDLE` idle connections the
oldest idle ones are closed.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from aiohttp import web

from rlhf_async.log import get_logger
from rlhf_async.modeling.env_calls import env_loop
from rlhf_async.task.agents.agent_session import PolicyFailed, RequestError, Session

log = get_logger(component="endpoint")
MODEL = "policy"  # the name /models lists
KEEPALIVE_S = 120.0
MAX_IDLE = 256


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind}}, status=status)


class _Idle:
    """The idle keep-alive connections, longest idle first (see the module)."""

    def __init__(self) -> None:
        self.conns: OrderedDict[asyncio.BaseTransport, None] = OrderedDict()

    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                         ) -> web.StreamResponse:
        conn = request.transport
        if conn is not None:
            self.conns.pop(conn, None)
        try:
            resp = await handler(request)
            resp.headers["Keep-Alive"] = f"timeout={int(KEEPALIVE_S)}"
            return resp
        finally:
            if conn is not None and not conn.is_closing():
                self.conns[conn] = None
                self._trim()

    def _trim(self) -> None:
        if len(self.conns) <= MAX_IDLE:
            return
        for gone in [c for c in self.conns if c.is_closing()]:  # closed by their clients
            del self.conns[gone]
        while len(self.conns) > MAX_IDLE:
            self.conns.popitem(last=False)[0].close()


class Endpoint:
    """The process's server and its open sessions (see the module)."""

    def __init__(self) -> None:
        self.sessions: dict[str, Session] = {}
        self._ids = itertools.count()
        self._runner: web.AppRunner | None = None
        self._starting = asyncio.Lock()
        self.idle = _Idle()
        self.port = 0

    async def start(self) -> None:
        """Listen (once; on the environment loop)."""
        async with self._starting:
            if self._runner is None:
                await self._listen()

    async def _listen(self) -> None:
        app = web.Application(client_max_size=64 * 2**20, middlewares=[self.idle.middleware])
        app.router.add_get("/s/{sid}/v1/models", self._models)
        app.router.add_post("/s/{sid}/v1/chat/completions", self._chat)
        app.router.add_post("/s/{sid}/v1/completions", self._complete)
        runner = web.AppRunner(app, access_log=None, keepalive_timeout=KEEPALIVE_S)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
        self._runner = runner
        log.info("agent endpoint listening", url=f"http://127.0.0.1:{self.port}")

    def open(self, session: Session, tag: str) -> tuple[str, str]:
        """(session id, its base URL)."""
        sid = f"{tag}-{next(self._ids)}"
        self.sessions[sid] = session
        return sid, f"http://127.0.0.1:{self.port}/s/{sid}/v1"

    def close(self, sid: str) -> None:
        self.sessions.pop(sid, None)

    def _session(self, request: web.Request) -> Session | None:
        return self.sessions.get(request.match_info["sid"])

    async def _models(self, request: web.Request) -> web.Response:
        if self._session(request) is None:
            return _error(404, "no such session (its episode is over)", "not_found_error")
        return web.json_response({"object": "list", "data": [
            {"id": MODEL, "object": "model", "created": 0, "owned_by": "rlhf-async"}]})

    async def _chat(self, request: web.Request) -> web.Response:
        return await self._serve(request, "chat")

    async def _complete(self, request: web.Request) -> web.Response:
        return await self._serve(request, "completion")

    async def _serve(self, request: web.Request, kind: str) -> web.Response:
        session = self._session(request)
        if session is None:
            return _error(404, "no such session (its episode is over)", "not_found_error")
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        if body.get("stream"):
            return _error(400, "stream: streaming is not served; send stream = false")
        if body.get("n", 1) != 1:
            return _error(400, f"n: one choice per request is served, got {body.get('n')!r}")
        try:
            out = await (session.chat_completion(body) if kind == "chat"
                         else session.completion(body))
        except RequestError as e:
            return _error(400, str(e))
        except PolicyFailed as e:
            return _error(500, f"the policy's generation failed: {e}", "server_error")
        except Exception as e:  # the template or tokenizer refused these messages
            return _error(400, f"could not render the request: {type(e).__name__}: {e}")
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        out.update(id=f"{prefix}-{request.match_info['sid']}-{session.calls}",
                   created=int(time.time()), model=str(body.get("model") or MODEL))
        return web.json_response(out)


_ENDPOINT: list[Endpoint] = []


async def endpoint() -> Endpoint:
    """The process's endpoint, started (call on the environment loop)."""
    if asyncio.get_running_loop() is not env_loop().loop:
        raise RuntimeError("the agent endpoint serves on the environment loop")
    if not _ENDPOINT:
        _ENDPOINT.append(Endpoint())
    await _ENDPOINT[0].start()
    return _ENDPOINT[0]
