"""Tools in the sandbox: a hang, a crash, 100 MB of output, a memory blow-up or a network
connection is a failed call whose observation says so; an episode reading it goes on."""

from __future__ import annotations

import asyncio
import sys

import pytest
import torch

from rlhf_async.modeling.environment import EpisodeSpec
from rlhf_async.modeling.episodes import run_episodes
from rlhf_async.modeling.generation import SamplingParams
from rlhf_async.modeling.rollout import ENV
from rlhf_async.task.agents.sandbox import network_namespace, run_python, run_tool
from tests.unit.modeling.test_episodes import _prompts, tiny_lm

NET = ("import socket\n"
       "socket.create_connection(('127.0.0.1', 9), timeout=2)\n"
       "print('connected')")
BAD = {"hang": "while True: pass",
       "crash": "import os; os.abort()",
       "flood": "import sys\nfor _ in range(1600): sys.stdout.write('x' * 65536)",  # 100 MB
       "memory": "x = bytearray(4 << 30)",
       "network": NET}


def _run(source, **kw):
    return asyncio.run(run_python(source, timeout_s=3.0, **kw))


def test_a_good_tool_returns_its_output():
    r = _run("import sys; print(sum(map(int, sys.stdin.read().split())))")
    assert r.ok and r.output == "0\n"
    assert asyncio.run(run_python("import sys; print(sys.stdin.read()[::-1])",
                                  "abc")).output == "cba\n"


@pytest.mark.parametrize("kind", sorted(BAD))
def test_a_bad_tool_is_a_failed_call(kind):
    r = _run(BAD[kind])
    assert not r.ok and r.observation().startswith("tool call failed: ")
    want = {"hang": "timed out after 3 s", "crash": "killed by signal 6",
            "flood": "output over 65536 bytes", "memory": "MemoryError",
            "network": "network access is disabled"}[kind]
    assert want in r.output


def test_network_is_cut_without_the_audit_hook_too():
    """The kernel's namespace alone (when this machine allows one): a non-Python tool is
    cut off as well."""
    if not network_namespace():
        pytest.skip("no network namespace here (unshare -rn refused): the audit hook holds")
    r = asyncio.run(_raw_connect())
    assert not r.ok and "unreachable" in r.output.lower()


async def _raw_connect():
    return await run_tool([sys.executable, "-c", NET], timeout_s=3.0)


class ToolEnv:
    """Each policy turn runs one of the bad tools; its failure is the observation."""

    def __init__(self) -> None:
        self.turn = 0

    async def reset(self, row):
        self.kinds = sorted(BAD)[row["seed"] % len(BAD):] + sorted(BAD)
        return ""

    async def step(self, action):
        r = await run_python(BAD[self.kinds[self.turn]], timeout_s=1.0)
        self.turn += 1
        return ("F" if not r.ok else "T"), 0.0, False


def test_an_episode_reads_failed_tool_calls_and_goes_on():
    spec = EpisodeSpec(ToolEnv, lambda toks: {}, lambda obs: [20 if obs == "F" else 21], str,
                       max_turns=2, max_tokens=20, timeout_s=10.0)
    params = SamplingParams(max_new_tokens=4, eos_id=2, pad_id=0,
                            stop_ids=tuple(range(3, 20)), episode=spec)
    b = run_episodes(tiny_lm(), _prompts(), params, spec, seed=0, step=0, version=0)
    env = b.response_ids[b.response_mask == ENV]
    assert len(env) > 0 and (env == 20).all()
    assert torch.isfinite(b.behaviour_logprobs).all()
