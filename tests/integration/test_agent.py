"""`task.agent` end to end: an `openai`-client agent trains a few steps under Flattening and
Separation through the endpoint; its failures are counted and the run goes on."""

from __future__ import annotations

import json

import pytest

from rlhf_async import job
from rlhf_async.config import load_config
from rlhf_async.metrics import read_metrics
from tests.faults import trained_counts
from tests.text_model import text_job_files, text_job_overrides

pytestmark = [pytest.mark.timeout(300)]

# two policy turns; rewards "yes"; the sky question is a bug in the agent; on a "name ..."
# prompt the agent drops its history before the second turn (a new segment, trained too)
AGENT = '''
from openai import AsyncOpenAI


async def run(base_url, row):
    if row["prompt"].startswith("what is"):
        raise KeyError("sky")
    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        msgs = [{"role": "user", "content": row["prompt"]}]
        r = await client.chat.completions.create(model="policy", messages=msgs, max_tokens=3)
        msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                 {"role": "user", "content": "yes or no ?"}]
        if row["prompt"].startswith("name"):
            msgs = msgs[-1:]
        r = await client.chat.completions.create(model="policy", messages=msgs)
    return {"reward": float("yes" in (r.choices[0].message.content or ""))}
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return text_job_files(tmp_path_factory.mktemp("agent"), "agent.py", AGENT)


def _cfg(files, tmp_path, name, *overrides):
    return load_config(None, [
        *text_job_overrides(files, tmp_path, name),
        f"task.agent={json.dumps(str(files / 'agent.py') + ':run')}",
        "generation.max_episode_tokens=16", "run.eval_prompts=2", *overrides])


@pytest.mark.parametrize("strategy", ["flattening", "separation"])
def test_an_openai_client_agent_trains_and_its_failures_are_counted(files, tmp_path,
                                                                     strategy):
    more = ["placement.devices=2", "algo.max_staleness=0"] if strategy == "separation" \
        else []
    job.run(_cfg(files, tmp_path, strategy, f"placement.strategy={strategy}", *more))
    records = read_metrics(tmp_path / strategy / "metrics.jsonl")
    assert len(records) == 2
    ends = {k: sum(r[k] for r in records) for k in records[0] if k.startswith("episodes/")}
    assert ends["episodes/done"] + ends["episodes/truncated"] > 0
    assert ends["episodes/failed"] > 0  # the sky question's episodes, and the run went on
    assert sum(ends[f"episodes/{k}"] for k in ("done", "truncated", "failed", "timeout",
                                               "max_turns")) == 16
    # each rewritten episode's first segment trained as a sample of its own
    assert ends["episodes/new_segments"] > 0
    assert sum(r["samples"] for r in records) == 16 + ends["episodes/new_segments"]
    if strategy == "separation":
        assert set(trained_counts(tmp_path / strategy).values()) == {1}
    assert all(r["response_length"] > 0 for r in records)
