"""`task.env = "openenv:..."`: how an OpenEnv server's observations and actions map onto
the Env protocol, and the errors a user meets before any episode runs (`run --dry-run`
and the run's own checks import a `module:app` and reach a URL)."""

from __future__ import annotations

import importlib.util
import json
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from rlhf_async import job
from rlhf_async.cli import main
from rlhf_async.config import ConfigError, TaskConfig, load_config
from rlhf_async.task.adapters.openenv import (
    OpenEnvAdapter,
    OpenEnvFactory,
    action_field,
    check_server,
    observation_text,
)


def test_an_observations_text_is_its_text_field_else_its_json():
    assert observation_text({"text": "higher", "done": False, "reward": 0.0}) == "higher"
    assert observation_text({"output": "3", "score": 1}) == "3"
    assert observation_text({"board": [1, 2], "done": True, "metadata": {}}) == \
        '{"board": [1, 2]}'
    assert observation_text({"done": True}) == ""


def _schema_server(action: dict) -> HTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"action": action}).encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            """No request log on the test's stderr."""

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_the_action_field_is_the_schemas_one_string_field():
    one = _schema_server({"properties": {"metadata": {"type": "object"},
                                         "guess": {"type": "string"}}})
    two = _schema_server({"properties": {"a": {"type": "string"}, "b": {"type": "string"}}})
    try:
        assert action_field(f"http://127.0.0.1:{one.server_port}") == "guess"
        with pytest.raises(ConfigError, match=r"its action must have exactly one string "
                                              r"field .*\['a', 'b'\]"):
            action_field(f"ws://127.0.0.1:{two.server_port}")
    finally:
        one.shutdown()
        two.shutdown()


def test_a_spec_without_a_server_and_a_missing_extra_are_one_error(monkeypatch):
    none = TaskConfig(name="text", env="openenv:")
    assert [p.split(";")[0] for p in OpenEnvAdapter("", none).problems()] == [
        "task.env: 'openenv:' names no server"]
    with pytest.raises(ConfigError, match=r"'openenv:' names no server"):
        OpenEnvAdapter("", none).environment()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "openenv" else real(name, *a))
    import sys
    monkeypatch.setitem(sys.modules, "openenv.core.generic_client", None)
    with pytest.raises(ConfigError, match=r"needs the openenv-core package: pip install "
                                          r"'rlhf-async\[openenv\]'"):
        OpenEnvFactory("openenv:http://127.0.0.1:1")


# --- checked before anything starts: `run --dry-run` and the run's own checks ----------

GUESS_APP = "examples.openenv_guess.server:app"


@pytest.fixture(scope="module")
def text_job(tmp_path_factory):
    """A text task's model and prompts: an OpenEnv task.env is all a test adds."""
    from tests.text_model import make_text_model

    root = tmp_path_factory.mktemp("openenv_checks")
    (root / "p.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n"
                                          for p in ("guess a digit .", "name a digit .")))
    return [f"model.path={json.dumps(str(make_text_model(root / 'model')))}",
            "task.name=text", f"task.prompts={json.dumps(str(root / 'p.jsonl'))}",
            "task.max_turns=2"]


def _closed_port() -> int:
    """A port of 127.0.0.1 that nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _dry_run(text_job, tmp_path, env: str, capsys) -> tuple[int, str]:
    rc = main(["run", "--dry-run", *text_job, f"task.env={json.dumps('openenv:' + env)}",
               f"run.output_dir={json.dumps(str(tmp_path / 'runs'))}", "run.name=dry"])
    out = capsys.readouterr()
    return rc, out.out + out.err


@pytest.mark.parametrize(("env", "problem"), [
    ("nonexistent_module:app", r"no module 'nonexistent_module' \(looked in the working "
                               r"directory .* and the installed packages\)"),
    ("examples.openenv_guess.server:nope", r"module 'examples.openenv_guess.server' has no "
                                           r"attribute 'nope'"),
    ("examples/openenv_guess/server.py:app", r"names a file; the run serves a module path, "
                                             r".*'openenv:examples.openenv_guess.server:app'\?"),
])
def test_dry_run_refuses_an_app_that_does_not_import(text_job, tmp_path, capsys, env, problem):
    pytest.importorskip("openenv")
    rc, out = _dry_run(text_job, tmp_path, env, capsys)
    assert rc == 2, out
    assert re.search(problem, out), out
    assert "accepted: 'openenv:module.path:app'" in out and "Traceback" not in out
    assert not (tmp_path / "runs").exists()


def test_dry_run_refuses_a_url_that_cannot_be_reached(text_job, tmp_path, capsys):
    pytest.importorskip("openenv")
    url = f"http://127.0.0.1:{_closed_port()}"
    rc, out = _dry_run(text_job, tmp_path, url, capsys)
    assert rc == 2, out
    assert f"OpenEnv server {url} cannot be reached" in out and "start it first" in out
    assert "Traceback" not in out and not (tmp_path / "runs").exists()


def test_dry_run_passes_an_app_that_imports_and_a_server_that_answers(text_job, tmp_path,
                                                                      capsys):
    pytest.importorskip("openenv")
    rc, out = _dry_run(text_job, tmp_path, GUESS_APP, capsys)
    assert rc == 0 and "every check passed" in out, out
    server = _schema_server({"properties": {"guess": {"type": "string"}}})
    try:
        rc, out = _dry_run(text_job, tmp_path, f"http://127.0.0.1:{server.server_port}",
                           capsys)
    finally:
        server.shutdown()
    assert rc == 0 and "every check passed" in out, out


def test_a_run_stops_on_an_unreachable_server_before_it_starts_anything(text_job, tmp_path):
    """The run's own checks (not only --dry-run's), before the run directory or any
    process: the first episode would have been the first to know."""
    pytest.importorskip("openenv")
    url = f"ws://127.0.0.1:{_closed_port()}"
    cfg = load_config(None, [*text_job, f"task.env={json.dumps('openenv:' + url)}",
                             f"run.output_dir={json.dumps(str(tmp_path))}", "run.name=r"])
    with pytest.raises(ConfigError, match=f"OpenEnv server {url} cannot be reached"):
        job.run(cfg)
    assert not (tmp_path / "r").exists()


def test_a_server_that_is_not_openenv_is_named(tmp_path):
    """A URL that answers, but not as an OpenEnv server (no action schema; an HTTP
    error)."""
    other = _schema_server({"type": "object"})  # /schema's "action" lacks "properties"
    try:
        url = f"http://127.0.0.1:{other.server_port}"
        with pytest.raises(ConfigError, match=r"its action must have exactly one string"):
            check_server(f"openenv:{url}")
    finally:
        other.shutdown()
    missing = HTTPServer(("127.0.0.1", 0), _NotFound)
    threading.Thread(target=missing.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ConfigError, match=r"its /schema answered HTTP 404"):
            check_server(f"openenv:http://127.0.0.1:{missing.server_port}")
    finally:
        missing.shutdown()


class _NotFound(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_error(404)

    def log_message(self, *args):
        """No request log on the test's stderr."""


def test_the_local_server_takes_another_port_when_its_port_was_taken(monkeypatch):
    """The free port is found by binding and closing it, so on a busy host another process
    may bind it before uvicorn does ("address already in use"): the run tries another."""
    pytest.importorskip("openenv")
    from rlhf_async.task.adapters import openenv

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        ports = iter([busy.getsockname()[1], _closed_port()])
        monkeypatch.setattr(openenv, "free_port", lambda: next(ports))
        server = openenv._LocalServer(GUESS_APP)
        try:
            assert server.url.rsplit(":", 1)[1] != str(busy.getsockname()[1])
            assert action_field(server.url) == "guess"
        finally:
            server.stop()


def test_one_local_server_per_app_in_a_process():
    """A run makes its task more than once (the job's evaluation and the strategy's
    training): both reach one server of the app, not one each (~0.5 GB and a start each)."""
    pytest.importorskip("openenv")
    from rlhf_async.task.adapters import openenv

    first = OpenEnvFactory(f"openenv:{GUESS_APP}")
    second = OpenEnvFactory(f"openenv:{GUESS_APP}")
    try:
        assert first._connection() == second._connection()
        assert first._server is second._server
    finally:
        openenv.stop_local_servers()
