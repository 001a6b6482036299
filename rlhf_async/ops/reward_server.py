"""`rlhf-async serve-reward path.py:fn`: a Python reward function served over HTTP, for
`task.reward = "http://HOST:PORT/PATH"` (the client: `task/rewards/remote_reward.py`).

POST PATH with `{"prompts": [str, ...], "responses": [str, ...], "columns": {name: [one
value per row], ...}}` ("columns" may be left out) -> 200 `{"rewards": [float, ...]}`. The
function is loaded and called by `RuleReward`, exactly as `task.reward = "path.py:fn"` is in
a job (per sample, or once per request with `batched`; each row's columns by name; every
value checked), so a served rule gives what the in-process one gives. A body that is not
that shape is answered 400 with what is wrong; a failing call 500 with the function's error
(`{"error": "..."}` both). Calls run one at a time on the rule's own thread: a request
waits for the one before it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from aiohttp import web

from rlhf_async.log import get_logger
from rlhf_async.task.rewards.reward_fn import RewardFunctionError, RuleReward

log = get_logger(component="reward_server")
MAX_BODY = 64 << 20  # bytes of one request; more is answered 413
FIELDS = ("prompts", "responses", "columns")
RULE: web.AppKey[RuleReward] = web.AppKey("rule", RuleReward)


class BadRequest(ValueError):
    """A request body that is not {"prompts": [...], "responses": [...], "columns": {...}}."""


def _strings(data: dict[str, Any], key: str) -> list[str]:
    value = data.get(key)
    if not isinstance(value, list):
        raise BadRequest(f'"{key}" must be a list of strings, got '
                         f"{type(value).__name__ if key in data else 'nothing'}")
    bad = next((i for i, v in enumerate(value) if not isinstance(v, str)), None)
    if bad is not None:
        raise BadRequest(f'"{key}"[{bad}] is a {type(value[bad]).__name__}, not a string')
    return value


def parse_request(data: Any) -> tuple[list[str], list[str], list[dict[str, Any]]]:
    """(prompts, responses, each row's columns) of a request body; BadRequest saying what
    is wrong otherwise."""
    if not isinstance(data, dict):
        raise BadRequest(f"the body is a JSON {type(data).__name__}; expected an object "
                         '{"prompts": [...], "responses": [...], "columns": {...}}')
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise BadRequest(f"unknown fields {unknown}; accepted: {list(FIELDS)}")
    prompts, responses = _strings(data, "prompts"), _strings(data, "responses")
    if len(prompts) != len(responses):
        raise BadRequest(f"{len(prompts)} prompts but {len(responses)} responses; expected "
                         "one prompt per response")
    columns = data.get("columns", {})
    if not isinstance(columns, dict):
        raise BadRequest(f'"columns" must be an object of lists, got {type(columns).__name__}')
    for name, values in columns.items():
        if not isinstance(values, list) or len(values) != len(prompts):
            got = f"{len(values)} values" if isinstance(values, list) else \
                type(values).__name__
            raise BadRequest(f'"columns"["{name}"] must be a list of one value per response '
                             f"({len(prompts)}), got {got}")
    rows = [{k: v[i] for k, v in columns.items()} for i in range(len(prompts))]
    return prompts, responses, rows


def _answer(status: int, **body: Any) -> web.Response:
    return web.json_response(body, status=status)


async def _score(request: web.Request) -> web.Response:
    try:
        prompts, responses, rows = parse_request(json.loads(await request.read()))
    except BadRequest as e:
        return _answer(400, error=f"bad request: {e}")
    except ValueError as e:  # not JSON, or not UTF-8
        return _answer(400, error=f"bad request: the body is not JSON ({e})")
    rule = request.app[RULE]
    try:
        rewards = await asyncio.to_thread(rule, prompts, responses, rows,
                                          list(range(len(prompts))))
    except RewardFunctionError as e:  # the function's own error, for the client to show
        log.warning("reward_failed", error="; ".join(e.problems))
        return _answer(500, error="; ".join(e.problems))
    return _answer(200, rewards=rewards)


def make_app(rule: RuleReward, path: str) -> web.Application:
    """The server's application: POST `path` scores with `rule`; anything else is answered
    404 (another path) or 405 (another method) naming what it serves."""

    async def elsewhere(request: web.Request) -> web.Response:
        return _answer(405 if request.path == path else 404,
                       error=f"{request.method} {request.path}: this server scores POST {path}")
    app = web.Application(client_max_size=MAX_BODY)
    app[RULE] = rule
    app.router.add_post(path, _score)
    app.router.add_route("*", "/{tail:.*}", elsewhere)
    return app


async def serve(rule: RuleReward, host: str, port: int, path: str,
                ready: Callable[[str], None]) -> None:
    """Serve `rule` at http://host:port/path until cancelled; `ready(url)` once it listens
    (port 0: a free one)."""
    runner = web.AppRunner(make_app(rule, path), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1]
        shown = f"[{host}]" if ":" in host else host
        ready(f"http://{shown}:{bound}{path}")
        log.info("reward_server_listening", host=host, port=bound, path=path,
                 reward=rule.spec)
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
