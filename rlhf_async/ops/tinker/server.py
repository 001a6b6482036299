"""The Tinker HTTP API under /api/v1/ (aiohttp), as the `tinker` client SDK 0.38.0 calls it.

    rlhf-async serve --api 127.0.0.1:8000      # beside the job daemon, same state dir
    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-... python my_loop.py

Auth: with an API key (`RLHF_ASYNC_API_KEY` or `--api-key-file`), every request must carry
it in `X-API-Key` (compared in constant time); without one the server listens only on a
loopback address. A refused or malformed request is a JSON `{"detail": ...}` with a 4xx
status; a retried POST with the same `X-Idempotency-Key` gets the first answer again.
"""

from __future__ import annotations

import hmac
import inspect
import ipaddress
import json
import socket
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

from aiohttp import web

from rlhf_async.log import get_logger
from rlhf_async.ops.tinker import checkpoints, proto, schema
from rlhf_async.ops.tinker.futures import ApiError
from rlhf_async.ops.tinker.service import TinkerService, client_config

log = get_logger(component="tinker_api")
MAX_BODY = 64 << 20  # the client sends forward_backward chunks of up to ~5 MB
IDEMPOTENT_KEEP = 4096  # answers kept by X-Idempotency-Key
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ApiConfigError(ValueError):
    """The server cannot start as asked (address, key): one line for the CLI."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: what it resolves to
        try:
            return all(ipaddress.ip_address(a[4][0]).is_loopback
                       for a in socket.getaddrinfo(host, None))
        except OSError:
            return False


def check_key(host: str, key: str | None) -> None:
    if key is not None and not key.startswith("tml-"):
        raise ApiConfigError("the API key must start with 'tml-' (the tinker client sends no "
                             "other)")
    if key is None and not is_loopback(host):
        raise ApiConfigError(f"--api {host}: a non-loopback address needs an API key (set "
                             "RLHF_ASYNC_API_KEY or --api-key-file); without one the API "
                             "listens on 127.0.0.1 only")


def _json(value: Any, status: int = 200) -> web.Response:
    return web.json_response(value, status=status, dumps=lambda v: json.dumps(v))


class ApiServer:
    def __init__(self, service: TinkerService, host: str, port: int,
                 api_key: str | None) -> None:
        check_key(host, api_key)
        self.service, self.host, self.port, self.api_key = service, host, port, api_key
        self._answers: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._runner: web.AppRunner | None = None

    # ---- the app -----------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY, middlewares=[self._guard])
        s = self.service
        post = {
            "client/config": lambda b: client_config(),
            "client/dynamic_config": lambda b: {},
            "telemetry": lambda b: {"status": "accepted"},
            "create_session": lambda b: s.create_session(
                schema.decode(b, schema.CreateSession, "create_session")),
            "session_heartbeat": lambda b: s.heartbeat(
                schema.decode(b, schema.SessionRef, "session_heartbeat")),
            "create_model": lambda b: s.create_model(
                schema.decode(b, schema.CreateModel, "create_model")),
            "get_info": lambda b: s.get_info(schema.decode(b, schema.ModelRef, "get_info")),
            "forward_backward": s.forward_backward,
            "optim_step": lambda b: s.optim_step(
                schema.decode(b, schema.OptimStep, "optim_step")),
            "save_weights_for_sampler": lambda b: s.save_weights_for_sampler(
                schema.decode(b, schema.SaveWeightsForSampler, "save_weights_for_sampler")),
            "create_sampling_session": lambda b: s.sampling.create(
                schema.decode(b, schema.CreateSamplingSession, "create_sampling_session")),
            "asample": lambda b: s.sampling.asample(
                schema.decode(b, schema.Sample, "asample")),
            "save_weights": lambda b: checkpoints.save_weights(
                s, schema.decode(b, schema.SaveWeights, "save_weights")),
            "load_weights": lambda b: checkpoints.load_weights(
                s, schema.decode(b, schema.LoadWeights, "load_weights")),
        }
        for path, fn in post.items():
            app.router.add_post(f"/api/v1/{path}", self._route(fn))
        app.router.add_post("/api/v1/sessions/{sid}/finish", self._finish)
        app.router.add_get("/api/v1/samplers/{sid}", self._sampler)
        app.router.add_post("/api/v1/retrieve_future", self._retrieve)
        app.router.add_get("/api/v1/healthz", lambda r: self._ok({"status": "ok"}))
        app.router.add_get("/api/v1/get_server_capabilities",
                           lambda r: self._ok(s.capabilities()))
        return app

    async def _ok(self, value: Any) -> web.Response:
        return _json(value)

    def _route(self, fn: Callable[[bytes], Any]) -> Handler:
        """A POST whose body goes to `fn` (sync, or a coroutine function's result awaited)
        and whose JSON answer is kept by the request's idempotency key."""
        async def handle(request: web.Request) -> web.StreamResponse:
            key = request.headers.get("X-Idempotency-Key")
            if key is not None and key in self._answers:
                return _json(self._answers[key])
            reply = fn(await request.read())
            if inspect.isawaitable(reply):
                reply = await reply
            if key is not None:
                self._answers[key] = reply
                while len(self._answers) > IDEMPOTENT_KEEP:
                    self._answers.popitem(last=False)
            return _json(reply)
        return handle

    async def _sampler(self, request: web.Request) -> web.Response:
        return _json(await self.service.sampling.get(request.match_info["sid"]))

    async def _finish(self, request: web.Request) -> web.Response:
        return _json(self.service.finish_session(request.match_info["sid"]))

    async def _retrieve(self, request: web.Request) -> web.Response:
        req = schema.decode(await request.read(), schema.RetrieveFuture, "retrieve_future")
        kind, value = await self.service.retrieve(req)
        if kind == "proto":
            return web.Response(body=value, content_type=proto.CONTENT_TYPE)
        return _json(value)

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self.api_key is not None and not hmac.compare_digest(
                request.headers.get("X-API-Key", "").encode(), self.api_key.encode()):
            return _json({"detail": "missing or wrong API key (X-API-Key)"}, 401)
        try:
            return await handler(request)
        except ApiError as e:
            return _json({"detail": str(e)}, e.status)
        except web.HTTPNotFound:
            return _json({"detail": f"{request.method} {request.path} is not served by this "
                                    "server (see README: the Tinker API section)"}, 404)
        except web.HTTPException:
            raise
        except Exception:
            log.exception("request failed", path=request.path)
            return _json({"detail": f"internal error in {request.path} (see the server's "
                                    "log)"}, 500)

    # ---- running -----------------------------------------------------------------------
    async def start(self) -> str:
        """Listen; returns the base URL (the bound port when 0 was asked)."""
        runner = self._runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        try:
            await site.start()
        except OSError as e:  # the port is taken, the address is not this machine's
            await runner.cleanup()
            raise ApiConfigError(f"--api: cannot listen on {self.host}:{self.port}: "
                                 f"{e.strerror or e}") from None
        self.port = runner.addresses[0][1]
        self.service.start_reaper()
        url = f"http://{self.host}:{self.port}"
        log.info("tinker api serving", url=url, auth=self.api_key is not None,
                 state_dir=str(self.service.root))
        return url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.service.aclose()

    async def run_beside(self, main: Coroutine[Any, Any, int]) -> int:
        """Serve while `main` (the job daemon) runs; stop with it."""
        try:
            await self.start()
        except BaseException:
            main.close()  # never started
            raise
        try:
            return await main
        finally:
            await self.stop()


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ApiConfigError(f"--api {text!r}: expected HOST:PORT, e.g. 127.0.0.1:8000")
    return host.strip("[]"), int(port)


def read_key(env: str | None, key_file: Path | None) -> str | None:
    if key_file is not None:
        try:
            return key_file.read_text().strip() or None
        except OSError as e:
            raise ApiConfigError(f"--api-key-file {key_file}: {e.strerror}") from None
    return env or None
