"""`rlhf-async serve-reward`'s server: a body that is not the protocol's shape is answered
400 saying what is wrong; the function's own failure 500 with its error; the command without
aiohttp is one line naming the extra."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request

import pytest

from rlhf_async.cli.main import main as cli_main
from rlhf_async.ops.reward_server import make_app
from rlhf_async.task.rewards.reward_fn import RuleReward
from tests.served import serving

pytestmark = [pytest.mark.timeout(60)]


def post(url: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def length(prompt: str, response: str, bonus: float = 0.0) -> float:
    if response == "boom":
        raise KeyError("boom")
    return len(response) + bonus


BAD = [
    (b"not json", "the body is not JSON (Expecting value: line 1 column 1 (char 0))"),
    (b"\xff\xfe", "the body is not JSON ("),
    (b"[1, 2]", "the body is a JSON list; expected an object {\"prompts\": [...], "
                "\"responses\": [...], \"columns\": {...}}"),
    (b'{"prompts": [], "responses": [], "extra": 1}',
     "unknown fields ['extra']; accepted: ['prompts', 'responses', 'columns']"),
    (b'{"prompts": "a", "responses": []}', '"prompts" must be a list of strings, got str'),
    (b'{"prompts": ["a", 2], "responses": []}', '"prompts"[1] is a int, not a string'),
    (b'{"prompts": ["a"], "responses": []}',
     "1 prompts but 0 responses; expected one prompt per response"),
    (b'{"prompts": ["a"], "responses": ["b"], "columns": []}',
     '"columns" must be an object of lists, got list'),
    (b'{"prompts": ["a"], "responses": ["b"], "columns": {"bonus": [1, 2]}}',
     '"columns"["bonus"] must be a list of one value per response (1), got 2 values'),
]


def test_bad_bodies_are_400_and_the_function_scores_the_rest():
    rule = RuleReward(length, "length", False, 5.0, "the request")
    with serving(make_app(rule, "/score"), "/score") as url:
        for body, message in BAD:
            status, answer = post(url, body)
            assert status == 400 and answer["error"].startswith(f"bad request: {message}"), \
                (body, answer)
        body = {"prompts": ["a", "b"], "responses": ["xy", ""], "columns": {"bonus": [1, 0.5]}}
        assert post(url, json.dumps(body).encode()) == (200, {"rewards": [3.0, 0.5]})
        status, answer = post(url, b'{"prompts": ["a", "b"], "responses": ["x", "boom"]}')
        assert status == 500 and answer == {"error": "task.reward: length raised KeyError: "
                                            "'boom' on prompt 1 of the request (prompt 'b', "
                                            "response 'boom')"}
        assert post(url.replace("/score", "/other"), b"{}") == (
            404, {"error": "POST /other: this server scores POST /score"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url, timeout=30)
        assert e.value.code == 405 and json.loads(e.value.read()) == {
            "error": "GET /score: this server scores POST /score"}


def test_without_aiohttp_the_command_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "aiohttp", None)  # import aiohttp fails
    monkeypatch.delitem(sys.modules, "rlhf_async.ops.reward_server")
    rc = cli_main(["serve-reward", "rlhf_async.task.sort_digits:rule", "--port", "0"])
    assert rc == 1 and capsys.readouterr().err == (
        "rlhf-async serve-reward: error: serve-reward needs aiohttp: pip install "
        "'rlhf-async[remote-reward]'\n")


def test_bad_arguments_are_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["serve-reward", "x.py:f", "--port", "70000"])
    assert e.value.code == 2 and "'70000' is not a port (0-65535" in capsys.readouterr().err
    rc = cli_main(["serve-reward", "no_such_module_anywhere:f", "--port", "0"])
    assert rc == 2 and "cannot import 'no_such_module_anywhere'" in capsys.readouterr().err
