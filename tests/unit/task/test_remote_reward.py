"""A reward server (`task.reward = "http://..."`) against tiny aiohttp servers on 127.0.0.1:
the served rule gives the in-process rule's numbers; a server that is down, slow past the
timeout, busy, wrong or not JSON is one clear error naming the URL and what it answered."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time

import pytest
import torch
from aiohttp import web

from rlhf_async.config import ConfigError, TaskConfig, load_config
from rlhf_async.modeling.rollout import RolloutBatch
from rlhf_async.ops.reward_server import make_app
from rlhf_async.rl.scoring import RewardMix
from rlhf_async.task import make_task, reward_mix
from rlhf_async.task.rewards.remote_reward import RemoteReward, RewardServerError, load_rule
from rlhf_async.task.rewards.reward_fn import RewardFunctionError, RuleReward
from rlhf_async.task.sort_digits import TOKEN_CHARS, SortDigitsTask, rule, tokens_text
from tests.served import serving

pytestmark = [pytest.mark.timeout(60)]
PROMPTS, RESPONSES = ["12", "30", "5"], ["12$", "03$", "55"]


def client(url: str, **over: object) -> RemoteReward:
    t = TaskConfig(reward=url, reward_timeout_s=5.0, reward_retries=1, reward_backoff_s=0.01)
    for k, v in over.items():
        setattr(t, k, v)
    return RemoteReward(url, t)


def app_of(handler) -> web.Application:
    app = web.Application()
    app.router.add_post("/reward", handler)
    return app


def call(c: RemoteReward, n: int = 3) -> list[float]:
    return c(PROMPTS[:n], RESPONSES[:n], [{}] * n, list(range(n)))


def test_the_text_rule_is_the_built_in_hidden_score():
    rng = random.Random(0)
    for _ in range(500):
        prompt = [rng.randrange(10) for _ in range(rng.randint(2, 6))]
        tokens = [rng.randrange(len(TOKEN_CHARS)) for _ in range(rng.randint(0, 8))]
        if rng.random() < 0.5:
            tokens = [4 + d for d in sorted(prompt)] + [3]
        want = SortDigitsTask.hidden_score_tokens(prompt, tokens)
        assert rule("".join(map(str, prompt)), tokens_text(tokens)) == want
    assert rule("12", "12$") == 1.0 and rule("21", "21$") == 0.0 and rule("12", "12") == 0.0
    with pytest.raises(ValueError, match="not characters of"):
        rule("12", "1x$")


def test_served_rule_gives_the_in_process_numbers_with_columns():
    fn_rule = RuleReward.load("rlhf_async.task.sort_digits:rule", False, 5.0, "the request")
    with serving(make_app(fn_rule, "/reward")) as url:
        assert call(client(url)) == [rule(p, r) for p, r in zip(PROMPTS, RESPONSES, strict=True)]
        assert client(url)([], [], [], []) == []
    seen = []

    def by_column(prompt, response, answer):
        seen.append(answer)
        return float(response == answer)
    columns = [{"answer": "12$", "other": 1}, {"answer": "x"}, {"answer": "55"}]
    with serving(make_app(RuleReward(by_column, "by_column", False, 5.0), "/reward")) as url:
        got = client(url, reward_request_rows=2)(PROMPTS, RESPONSES, columns, [0, 1, 2])
    assert got == [1.0, 0.0, 1.0] and sorted(seen) == ["12$", "55", "x"]


def test_sort_digits_scores_through_the_server():
    # the task's own path: tokens -> texts -> request -> the same scores as built in
    fn_rule = RuleReward.load("rlhf_async.task.sort_digits:rule", False, 5.0, "the request")
    with serving(make_app(fn_rule, "/reward")) as url:
        cfg = load_config(None, [f'task.reward="{url}"', "task.reward_request_rows=3"])
        task, plain = make_task(cfg), SortDigitsTask(TaskConfig())
        b = task.prompt_batch(0, "train", 0, 4, 2)
        resp = torch.randint(0, 16, (8, 5))
        mask = (torch.rand(8, 5) < 0.8).long()
        got = task.hidden_scores(b.prompt_ids, resp, mask)
        torch.testing.assert_close(got, plain.hidden_scores(b.prompt_ids, resp, mask))
        assert reward_mix(cfg, task).overlap and not reward_mix(load_config(None, []),
                                                                  plain).overlap


def test_a_server_that_is_down_is_one_error_after_the_retries():
    with socket.socket() as s:  # bound, not listening: connections are refused
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/reward"
        t0 = time.monotonic()
        with pytest.raises(RewardServerError) as e:
            call(client(url, reward_retries=2, reward_backoff_s=0.05))
    assert time.monotonic() - t0 >= 0.05 + 0.1  # backoff 0.05, then 0.1
    assert str(e.value) == (f"task.reward: reward server {url} could not be reached "
                            "(Connection refused) (the last of 3 tries; task.reward_retries "
                            "= 2)")
    assert isinstance(e.value, RewardFunctionError)  # stops the run as a failing rule does


def test_a_server_slower_than_the_timeout():
    async def slow(request):
        await asyncio.sleep(1)
        return web.json_response({"rewards": [0.0] * 3})
    with serving(app_of(slow)) as url, pytest.raises(RewardServerError) as e:
        call(client(url, reward_timeout_s=0.2, reward_retries=1))
    assert e.value.problems == [f"task.reward: reward server {url} gave no answer within "
                                "task.reward_timeout_s = 0.2 s (the last of 2 tries; "
                                "task.reward_retries = 1)"]


def test_wrong_length_not_json_and_other_statuses_are_not_retried():
    tries = []

    async def wrong(request):
        tries.append(request.path)
        return web.json_response({"rewards": [1.0]})

    async def html(request):
        tries.append(request.path)
        return web.Response(text="<html>" + "x" * 500 + "</html>", content_type="text/html")

    async def missing(request):
        tries.append(request.path)
        return web.json_response({"error": "no such thing"}, status=404)

    cases = [(wrong, "answered 1 rewards for 3 responses; expected one per response"),
             (html, "answered 200 with a body that is not JSON: '<html>xxx"),
             (missing, "answered 404 Not Found: '{\"error\": \"no such thing\"}'")]
    for handler, message in cases:
        tries.clear()
        with serving(app_of(handler)) as url, pytest.raises(RewardServerError) as e:
            call(client(url, reward_retries=3))
        assert e.value.problems[0].startswith(f"task.reward: reward server {url} {message}")
        assert len(tries) == 1  # a wrong answer is not asked again
    assert e.value.problems[0].count("x") < 250  # a snippet of the body, not all of it


def test_a_busy_server_is_asked_again_and_bad_rewards_are_refused():
    answers = iter([503, 429, 200])

    async def busy(request):
        status = next(answers)
        return web.json_response({"rewards": [0.5, True, 1]} if status == 200 else {},
                                 status=status)
    with serving(app_of(busy)) as url:
        assert call(client(url, reward_retries=2)) == [0.5, 1.0, 1.0]

    async def nan(request):
        return web.Response(text='{"rewards": [1, NaN, 2]}')
    with serving(app_of(nan)) as url, pytest.raises(RewardServerError, match=(
            r"answered nan as reward 1 of 3; a reward is a finite number")):
        call(client(url))


def test_requests_in_flight_are_bounded_and_rewards_keep_their_order():
    live, most = [0], [0]

    async def counting(request):
        body = await request.json()
        live[0] += 1
        most[0] = max(most[0], live[0])
        await asyncio.sleep(0.05)
        live[0] -= 1
        return web.json_response({"rewards": [float(p) for p in body["prompts"]]})
    prompts = [str(i) for i in range(9)]
    with serving(app_of(counting)) as url:
        c = client(url, reward_request_rows=2, reward_max_in_flight=2)
        assert c(prompts, prompts, [{}] * 9, list(range(9))) == [float(i) for i in range(9)]
    assert most[0] == 2


def test_the_mix_overlaps_the_rule_with_the_forwards():
    released = threading.Event()

    def waits(prompt_ids, response_ids, mask):  # as a server does: the answer comes later
        assert released.wait(10), "the rule ran in the caller's thread"
        return torch.tensor([1.0, 0.0])
    batch = RolloutBatch(*(torch.zeros(2, 2, dtype=torch.long),) * 4, torch.zeros(2, 2),
                         torch.arange(2), torch.arange(2))
    mix = RewardMix(waits, overlap=True)
    started = mix.start(batch)
    released.set()  # the caller's forwards run here, while the rule waits
    rewards, hidden = mix.combine(None, batch, started)
    assert rewards.tolist() == [1.0, 0.0] and hidden.tolist() == [1.0, 0.0]
    assert RewardMix(waits).start(batch) is None  # in-process rules run in combine


def test_load_rule_picks_function_server_or_nothing():
    assert load_rule(TaskConfig(), "task.prompts") is None
    assert isinstance(load_rule(TaskConfig(reward="http://127.0.0.1:1/r"), "x"), RemoteReward)
    assert isinstance(load_rule(TaskConfig(reward="rlhf_async.task.sort_digits:rule"), "x"),
                      RuleReward)


@pytest.mark.parametrize("spec,message", [
    ("http://:80/x", "'http://:80/x' names no host; expected 'http://HOST:PORT/PATH'"),
    ("http://h:99999/", "'http://h:99999/' is not a usable URL (Port out of range 0-65535)"),
    ("reward", "'reward' is neither 'module.path:function', 'path/to/file.py:function' nor "
               "a reward server 'http://HOST:PORT/PATH'"),
])
def test_bad_urls_are_config_errors(spec, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"task.reward={json.dumps(spec)}"])
    assert e.value.problems == [f"task.reward: {message}"]
    load_config(None, ['task.reward="https://judge.example:8443/score?model=a"'])
