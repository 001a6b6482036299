"""The run's own OpenEnv server sends no keepalive pings: on 2 loaded cores the episodes'
client answered them late and uvicorn (20 s timeout) closed every open session with
"1011 keepalive ping timeout", failing the run at its first evaluation."""

import os
import sys

import pytest

from rlhf_async.task.adapters import openenv

uvicorn = pytest.importorskip("uvicorn")  # the [openenv] extra's


def test_the_local_server_runs_without_keepalive_pings(monkeypatch):
    seen: dict = {}
    monkeypatch.setattr(uvicorn, "run", lambda target, **kw: seen.update(kw, target=target))
    monkeypatch.setattr(sys, "path", list(sys.path))
    openenv._serve("examples.openenv_guess.server:app", 0, os.getppid())
    assert seen["target"] == "examples.openenv_guess.server:app"
    assert seen["ws_ping_interval"] is None
