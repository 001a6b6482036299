"""`task.env = "openenv:..."`: how an OpenEnv server's observations and actions map onto
the Env protocol, and the errors a user meets before any episode runs."""

from __future__ import annotations

import importlib.util
import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from rlhf_async.config import ConfigError
from rlhf_async.task.environment import load_env
from rlhf_async.task.openenv_env import OpenEnvFactory, action_field, observation_text


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
    with pytest.raises(ConfigError, match=r"'openenv:' names no server"):
        load_env("openenv:")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "openenv" else real(name, *a))
    import sys
    monkeypatch.setitem(sys.modules, "openenv.core.generic_client", None)
    with pytest.raises(ConfigError, match=r"needs the openenv-core package: pip install "
                                          r"'rlhf-async\[openenv\]'"):
        OpenEnvFactory("openenv:http://127.0.0.1:1")
