"""OpenEnv environments as `task.env`: `"openenv:<module:app>"` (a server this process
starts locally with uvicorn, on a free port, at its first episode) or `"openenv:<URL>"`
(a running server, http(s):// or ws(s)://), driven through OpenEnv's own client.

One WebSocket session per episode (a fresh `GenericEnvClient`, closed when the episode
ends), so a server must allow as many concurrent sessions as episodes run at once (its
`max_concurrent_envs`). The mapping onto our `Env` protocol:
- reset(row) -> `client.reset(seed=row["seed"])`, its observation's text;
- step(text) -> `client.step({FIELD: text})`, where FIELD is the action's one string
  field in the server's /schema; -> (observation text, reward or 0, done);
- an observation's text: its first string field among `TEXT_KEYS`, else the observation
  (without done/reward/metadata) as JSON.
The package is an extra (`pip install 'rlhf-async[openenv]'`), imported only here (it
takes seconds: gradio), so a run without an OpenEnv environment never pays for it.

Before anything starts (the run's checks and --dry-run: `OpenEnvAdapter.check_reachable`),
`check_server` imports a `module:app` in a fresh interpreter, as its server will, and
reads a URL's /schema: a mistake there is one ConfigError, not the first episode's.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from rlhf_async.config import ConfigError, TaskConfig
from rlhf_async.modeling.environment import Env
from rlhf_async.task.adapters.interface import Rows, Scorer

EXTRA = "pip install 'rlhf-async[openenv]'"
TEXT_KEYS = ("text", "prompt", "message", "observation", "content", "output")
START_TIMEOUT_S = 180.0  # its imports alone take ~10 s on an idle core
URL_SCHEMES = ("http://", "https://", "ws://", "wss://")
IMPORT_TIMEOUT_S = 120.0  # a fresh interpreter importing the user's app (openenv: ~4-10 s)
PORT_TRIES = 3  # ports tried for the local server (another process may take one first)


def accepted(prefix: str) -> str:
    """What task.env may say after `prefix` (the adapter's, from the spec the user wrote)."""
    return (f"accepted: '{prefix}:module.path:app' (an ASGI app such as OpenEnv's "
            "create_app(...), importable from the working directory; the run serves it) or "
            f"'{prefix}:http://HOST:PORT' (a running OpenEnv server; also https, ws, wss)")


def _client() -> Any:
    try:
        from openenv.core.generic_client import GenericEnvClient
    except ImportError:
        raise ConfigError([f"task.env: an OpenEnv environment needs the openenv-core "
                           f"package: {EXTRA}"]) from None
    return GenericEnvClient


def _http(url: str) -> str:
    return "http" + url[2:] if url.startswith("ws") else url


def _get(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def action_field(base: str, timeout: float = 5.0, prefix: str = "<prefix>") -> str:
    """The action's one string field in the server's /schema; one ConfigError otherwise
    (a server that cannot be reached, or answers no OpenEnv schema)."""
    try:
        schema = _get(f"{_http(base)}/schema", timeout)["action"]
        props = schema.get("properties", {})
    except urllib.error.HTTPError as e:  # before OSError: it is one
        raise ConfigError([f"task.env: OpenEnv server {base}: its /schema answered HTTP "
                           f"{e.code}; {accepted(prefix)}"]) from None
    except OSError as e:  # refused, no such host, timed out
        raise ConfigError([f"task.env: OpenEnv server {base} cannot be reached "
                           f"({getattr(e, 'reason', e)}): start it first; "
                           f"{accepted(prefix)}"]) \
            from None
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise ConfigError([f"task.env: OpenEnv server {base}: its /schema is not an "
                           f"OpenEnv server's (no action schema: {type(e).__name__} {e}); "
                           f"{accepted(prefix)}"]) from None
    text = [k for k, v in props.items() if k != "metadata" and v.get("type") == "string"]
    if len(text) != 1:
        raise ConfigError([f"task.env: OpenEnv server {base}: its action must have exactly "
                           f"one string field (the policy's text); its fields: "
                           f"{sorted(k for k in props if k != 'metadata')}"])
    return text[0]


def observation_text(obs: Any) -> str:
    if not isinstance(obs, dict):
        return str(obs)
    for k in TEXT_KEYS:
        if isinstance(obs.get(k), str):
            return str(obs[k])
    rest = {k: v for k, v in obs.items() if k not in ("done", "reward", "metadata")}
    return json.dumps(rest, sort_keys=True) if rest else ""


# run by a fresh interpreter from the working directory, as the local server imports the
# app (uvicorn `module:app`); not `-m` of this module, which would import torch first
_IMPORT_APP = """
import importlib, os, sys, traceback
sys.path.insert(0, os.getcwd())
module, _, attrs = sys.argv[1].partition(":")
try:
    app = importlib.import_module(module)
except BaseException as e:
    if isinstance(e, ModuleNotFoundError) and e.name and \\
            (module == e.name or module.startswith(e.name + ".")):
        sys.exit(f"no module {module!r} (looked in the working directory {os.getcwd()} "
                 "and the installed packages)")
    tb = traceback.extract_tb(e.__traceback__)
    at = f" (at {tb[-1].filename}:{tb[-1].lineno})" if tb else ""
    sys.exit(f"importing {module!r} raised {type(e).__name__}: {e}{at}")
for name in attrs.split("."):
    if not hasattr(app, name):
        sys.exit(f"module {module!r} has no attribute {attrs!r}")
    app = getattr(app, name)
if not callable(app):
    sys.exit(f"{attrs!r} in {module!r} is a {type(app).__name__}, not an ASGI app")
"""


def _app_problem(target: str) -> str | None:
    """What stops uvicorn from serving `target` ('module.path:app'), found by importing it
    as the server would; None when it imports and names an app."""
    try:
        done = subprocess.run([sys.executable, "-c", _IMPORT_APP, target], text=True,
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, timeout=IMPORT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"importing it took over {IMPORT_TIMEOUT_S:.0f} s"
    if done.returncode == 0:
        return None
    lines = done.stderr.strip().splitlines()
    return lines[-1] if lines else f"importing it exited with code {done.returncode}"


def _split(spec: str) -> tuple[str, str]:
    """(prefix, target) of `task.env`'s '<prefix>:<target>'."""
    prefix, _, target = spec.partition(":")
    return prefix, target


def _spec_problem(spec: str) -> str | None:
    """A target that is neither a URL nor 'module.path:app' (what uvicorn serves)."""
    prefix, target = _split(spec)
    if not target:
        return "names no server"
    if target.startswith(URL_SCHEMES):
        return None
    module, _, attrs = target.partition(":")
    if module.endswith(".py") or "/" in module:
        problem = "names a file; the run serves a module path, importable from the " \
                  "working directory"
        if module.startswith(("/", "..")):
            return problem
        dotted = module.removesuffix(".py").removeprefix("./").replace("/", ".")
        return f"{problem}: '{prefix}:{dotted}:{attrs or 'app'}'?"
    names = [*module.split("."), *attrs.split(".")]
    if not attrs or not all(n.isidentifier() for n in names):
        return "is neither a URL nor 'module.path:app'"
    return None


def check_server(spec: str) -> None:
    """Before anything starts (the run's checks, --dry-run): an OpenEnv URL answers with an
    action of one string field; a 'module:app' imports in a fresh interpreter, as the
    run's server will, and names an app. One ConfigError saying what is wrong."""
    target = _split(spec)[1]
    if target.startswith(URL_SCHEMES):
        action_field(target, prefix=_split(spec)[0])
        return
    problem = _spec_problem(spec)
    if problem:
        raise ConfigError([f"task.env: {spec!r} {problem}; {accepted(_split(spec)[0])}"])
    problem = _app_problem(target)
    if problem:
        raise ConfigError([f"task.env: {spec!r}: {problem}; {accepted(_split(spec)[0])}"])


def free_port() -> int:
    """A local port nothing listens on now (bound, then closed: another process may still
    take it before our server binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _LocalServer:
    """`uvicorn <module:app>` on a free local port, stopped when this process exits.

    In a session of its own: a stop signal sent to the run's process group (Ctrl-C in a
    terminal, GNU timeout, the job daemon) must reach the run, which finishes its step,
    and not the server, whose shutdown would fail that step's episodes in flight."""

    def __init__(self, target: str) -> None:
        atexit.register(self.stop)
        for _ in range(PORT_TRIES):
            problem = self._start(target, free_port())
            if problem is None:
                return
            if "address already in use" not in problem:  # a port taken between our
                break  # probe and uvicorn's bind (a busy host) is worth another port
        raise ConfigError([f"task.env: the OpenEnv server {target!r} {problem}"])

    def _start(self, target: str, port: int) -> str | None:
        """Start the server on `port` and wait for its /health; what went wrong, or None."""
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115  (lives as the server does)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rlhf_async.task.adapters.openenv", target, str(port),
             str(os.getpid())],
            # a file, not a pipe: a pipe nobody reads fills and blocks the server's logging
            stdout=subprocess.DEVNULL, stderr=self.log, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                err = self.log.read().strip()
                return (f"exited ({self.proc.returncode}) on start: "
                        f"{err.splitlines()[-1] if err else 'no output'}")
            try:
                _get(f"{self.url}/health", 1.0)
                return None
            except (OSError, ValueError):
                time.sleep(0.2)
        self.stop()
        return f"did not answer {self.url}/health within {START_TIMEOUT_S:.0f} s"

    def stop(self) -> None:
        if getattr(self, "proc", None) is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


_SERVERS: dict[str, _LocalServer] = {}  # this process's local servers, by app
_SERVERS_LOCK = threading.Lock()


def local_server(target: str) -> _LocalServer:
    """This process's server of `target` ('module:app'), started at the first call: a run
    makes its task more than once (the job's evaluation, the strategy's training), and
    each would otherwise start a server of its own (~0.5 GB, seconds to start)."""
    with _SERVERS_LOCK:
        server = _SERVERS.get(target)
        if server is None or server.proc.poll() is not None:  # none yet, or it died
            server = _SERVERS[target] = _LocalServer(target)
        return server


def stop_local_servers() -> None:
    """Stop this process's local servers (they also stop when it exits)."""
    with _SERVERS_LOCK:
        for server in _SERVERS.values():
            server.stop()
        _SERVERS.clear()


class OpenEnvEpisode:
    """One episode: one client session of the server."""

    def __init__(self, url: str, field: str) -> None:
        self.client = _client()(base_url=url)
        self.field = field

    async def reset(self, row: dict[str, Any]) -> str:
        r = await self.client.reset(seed=int(row["seed"]) % 2**31)
        return observation_text(r.observation)

    async def step(self, action: str) -> tuple[str, float, bool]:
        r = await self.client.step({self.field: action})
        return observation_text(r.observation), float(r.reward or 0.0), bool(r.done)

    async def close(self) -> None:
        await self.client.close()


class OpenEnvFactory:
    """`task.env`'s OpenEnv server: makes an episode's environment; a local server is
    started at the first episode (only processes that run episodes start one)."""

    def __init__(self, spec: str) -> None:
        self.prefix, self.target = _split(spec)
        problem = _spec_problem(spec)
        if problem:
            raise ConfigError([f"task.env: {spec!r} {problem}; {accepted(_split(spec)[0])}"])
        if importlib.util.find_spec("openenv") is None:  # one error when the task loads
            _client()
        self.remote = self.target.startswith(URL_SCHEMES)
        self._lock = threading.Lock()
        self._ready: tuple[str, str] | None = None
        self._server: _LocalServer | None = None

    def _connection(self) -> tuple[str, str]:
        with self._lock:
            if self._ready is None:
                if not self.remote:
                    self._server = local_server(self.target)
                url = self.target if self.remote else self._server.url  # type: ignore[union-attr]
                self._ready = (url, action_field(url, prefix=self.prefix))
            return self._ready

    def __call__(self) -> OpenEnvEpisode:
        return OpenEnvEpisode(*self._connection())


class OpenEnvAdapter:
    """`task.env = "openenv:<module:app or URL>"`: each episode a session of the server."""

    key, gives_prompts, gives_reward, preload = "env", False, True, ()

    def __init__(self, argument: str, task: TaskConfig) -> None:
        self.spec = task.env

    def problems(self) -> list[str]:
        problem = _spec_problem(self.spec)
        return [f"task.env: {self.spec!r} {problem}; {accepted(_split(self.spec)[0])}"] \
            if problem else []

    def check_reachable(self) -> None:
        check_server(self.spec)

    def rows(self) -> Rows | None:
        return None  # task.prompts are the prompts

    def rule(self) -> Scorer | None:
        return None  # the episode's step rewards

    def environment(self) -> Callable[[], Env]:
        return OpenEnvFactory(self.spec)

    def agent(self, tokenizer: Any) -> None:
        return None


def _serve(target: str, port: int, parent: int) -> None:
    """The local server's process: uvicorn on `target`, ended when `parent` is gone (a
    rank or node that exits without running atexit must not leave it behind)."""
    import uvicorn

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()
    sys.path.insert(0, os.getcwd())  # a module path is the user's, from where they run
    # no keepalive pings: on a loaded host (2 cores, load 8-10) the episodes' client
    # answered late and uvicorn's 20 s ping timeout closed every open session (1011)
    uvicorn.run(target, host="127.0.0.1", port=port, log_level="warning",
                ws_ping_interval=None)


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
