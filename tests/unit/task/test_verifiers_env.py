"""`task.env = "verifiers:<environment>"`: an installed verifiers environment (the example's
`vf_repeat`, built with the verifiers package) gives the prompts, and one episode is its
harness calling an OpenAI-compatible endpoint (a fake one here, answering what the test
says) and its rubric scoring the reply."""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from aiohttp import web

from rlhf_async.config import ConfigError, JobConfig, TaskConfig, load_config
from rlhf_async.task.adapters import adapter_problems
from rlhf_async.task.adapters.verifiers import VerifiersAgent, VerifiersEpisodeFailed, load
from rlhf_async.task.text import read_prompts
from tests.served import serving
from tests.text_model import make_text_model

pytest.importorskip("verifiers")
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "verifiers_env"
WORDS = ["apple", "pear", "cat", "dog", "sky", "sea"]
SYSTEM = {"role": "system", "content": "Answer with one word."}


@pytest.fixture(autouse=True)
def _example(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))


def _task(**verifiers) -> TaskConfig:
    return TaskConfig(name="text", env="verifiers:vf_repeat",
                      verifiers={"taskset": {"words": WORDS}, **verifiers})


def _user(word: str) -> dict[str, str]:
    return {"role": "user", "content": f"Repeat this word and nothing else: {word}"}


class FakeEndpoint:
    """/s/ep/v1/chat/completions answering each request with `reply(request body)`."""

    def __init__(self, reply) -> None:
        self.reply, self.bodies = reply, []
        self.app = web.Application()
        self.app.router.add_post("/s/ep/v1/chat/completions", self.chat)

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        text = self.reply(body)
        if text is None:
            return web.json_response({"error": {"message": "engine down"}}, status=500)
        return web.json_response({
            "id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": text}}]})


def _word(body) -> str:
    return body["messages"][-1]["content"].rsplit(" ", 1)[-1]


def test_the_tasks_are_the_prompts_as_the_harness_sends_them():
    prompts, columns = read_prompts(_task()).prompts, read_prompts(_task()).columns
    loaded = load("vf_repeat", _task())
    words = [t.data.answer for t in loaded.tasks]
    assert sorted(words) == sorted(WORDS)  # one task per word, in the taskset's order
    assert prompts == [[SYSTEM, _user(w)] for w in words]  # ChatHarness sends the system
    assert columns == [{"vf_task": i, "vf_key": t.key} for i, t in enumerate(loaded.tasks)]
    # without a chat template: one string; `select` bounds and picks the tasks
    flat = read_prompts(replace(_task(select={"limit": 2}), chat_template=False)).prompts
    assert flat == [f"Answer with one word.\n\n{_user(w)['content']}" for w in words[:2]]
    # a role left without a runtime runs in the local subprocess runtime
    assert loaded.env.config.agent.runtime.type == "subprocess"


def _episodes(reply, rows):
    agent = VerifiersAgent("vf_repeat", _task())
    fake = FakeEndpoint(reply)

    async def run(url):
        return await asyncio.gather(*(agent(url, row) for row in rows),
                                    return_exceptions=True)

    with serving(fake.app, "/s/ep/v1") as url:
        return asyncio.run(run(url)), fake.bodies, agent


def test_an_episode_is_the_harness_calling_the_endpoint_scored_by_the_rubric():
    columns = read_prompts(_task()).columns
    words = [t.data.answer for t in load("vf_repeat", _task()).tasks]
    replies = {words[0]: words[0], words[1]: f"it is {words[1]}.", words[2]: "no idea"}
    # three episodes at once: they share the environment's serving resources
    rewards, bodies, agent = _episodes(lambda b: replies[_word(b)],
                                       [{**columns[i], "prompt": "", "seed": i}
                                        for i in range(3)])
    assert rewards == [1.0, 0.5, 0.0]
    assert sorted(json.dumps(b["messages"]) for b in bodies) == \
        sorted(json.dumps([SYSTEM, _user(w)]) for w in words[:3])
    assert agent.users == 0 and agent.serving is None  # left by the last episode
    # a row is found by its task's key when its index does not match
    assert agent.task({"vf_task": 99, "vf_key": columns[4]["vf_key"]}).data.answer == words[4]
    with pytest.raises(VerifiersEpisodeFailed, match="names no task"):
        agent.task({"vf_task": 0, "vf_key": "nope"})


def test_a_failed_episode_raises_with_the_error_verifiers_recorded():
    columns = read_prompts(_task()).columns
    (out,), bodies, _ = _episodes(lambda b: None, [{**columns[0], "prompt": "", "seed": 0}])
    assert isinstance(out, VerifiersEpisodeFailed) and len(bodies) == 1
    assert "verifiers:vf_repeat: episode failed:" in str(out) and "500" in str(out)


def test_what_a_user_gets_wrong_is_one_clear_error(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"'no_such_env' is not an installed verifiers "
                                          r"environment .*installed: .*textarena"):
        load("no_such_env", TaskConfig(name="text", env="verifiers:no_such_env"))
    with pytest.raises(ConfigError, match=r"task.verifiers: the verifiers environment "
                                          r"'vf_repeat' refuses its config: taskset.colour"):
        load("vf_repeat", _task(taskset={"colour": 1}))
    with pytest.raises(ConfigError, match=r"task.verifiers: select: "):
        load("vf_repeat", _task(select={"limit": 0}))
    with pytest.raises(ConfigError, match=r"names no environment"):
        load("", TaskConfig(name="text", env="verifiers:"))
    monkeypatch.setitem(sys.modules, "verifiers", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    monkeypatch.setitem(sys.modules, "verifiers.v1.utils", None)
    with pytest.raises(ConfigError, match=r"needs the verifiers package: pip install "
                                          r"'rlhf-async\[verifiers\]'"):
        load("other_env", TaskConfig(name="text", env="verifiers:other_env"))


def test_the_config_checks_know_the_environment_gives_prompts_and_reward(tmp_path):
    model = make_text_model(tmp_path / "m")
    base = [f"model.path={json.dumps(str(model))}", "task.name=text"]
    cfg = load_config(None, [*base, "task.env=verifiers:vf_repeat"])  # no prompts, no reward
    assert cfg.task.env == "verifiers:vf_repeat"
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    prompts = f"task.prompts={json.dumps(str(tmp_path / 'p.jsonl'))}"
    both = load_config(None, [*base, "task.env=verifiers:vf_repeat", prompts])
    # the adapter registry's check (before anything starts: prepare_run, --dry-run)
    assert adapter_problems(both) == [
        f"task.prompts: {both.task.prompts!r} beside task.env = 'verifiers:vf_repeat': the "
        "'verifiers:' adapter's rows are the prompts; remove task.prompts"]
    assert adapter_problems(cfg) == []
    with pytest.raises(ConfigError, match=r"task.verifiers: configures the 'verifiers:' "
                                          r"adapter; task.env is '', not 'verifiers:...'"):
        load_config(None, [*base, "task.prompts=p.jsonl", "task.reward=r.py:f",
                           "task.verifiers={select = {limit = 2}}"])


def test_an_error_in_the_environments_code_names_it_and_where(tmp_path, monkeypatch):
    (tmp_path / "vf_broken.py").write_text(
        "import verifiers.v1 as vf\n\n\n"
        "class BrokenTaskset(vf.Taskset[vf.Task, vf.TasksetConfig]):\n"
        "    def load(self):\n"
        "        raise ValueError('no rows today')\n\n\n"
        "__all__ = ['BrokenTaskset']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"loading the verifiers environment 'vf_broken' "
                                          r"failed: ValueError: no rows today \(at .*"
                                          r"vf_broken.py:6\)"):
        load("vf_broken", TaskConfig(name="text", env="verifiers:vf_broken"))


def test_the_fork_server_imports_verifiers_for_a_verifiers_environment():
    from rlhf_async.task import task_preload

    assert task_preload(JobConfig(task=_task())) == ("verifiers.v1",)
    assert task_preload(JobConfig(task=TaskConfig(name="text", env="x.py:Env"))) == ()
