"""Every request of a rollout is built by one `Requests` value: the generator node's
scheduler and a colocated lock-step rank (`engine_rollout`) send the same requests for the
same rows (prompt, key, limits), single responses and episodes alike, and differ only in
their ids and in the weights their prefix-cache salt names."""

import asyncio
import dataclasses

import torch

from nodes.generator.inflight import Weights
from nodes.generator.scheduler import Scheduler
from rlhf_async.engines.interface import Completion, Request
from rlhf_async.engines.requests import Requests, engine_rollout
from rlhf_async.modeling.environment import EpisodeSpec
from rlhf_async.modeling.generation import SamplingParams, request_seed
from rlhf_async.pipeline.protocol import ChunkId
from tests.unit.nodes.generator.test_scheduling import PARAMS, FakeEngine, OkEnv, _prompts


def _keyed(requests: list[Request]) -> list[Request]:
    """The requests without what names them (ids, salt), in a stable order."""
    return sorted((dataclasses.replace(r, request_id="", cache_salt=None) for r in requests),
                  key=lambda r: (r.prompt_ids, r.seed))


def test_the_node_and_a_colocated_rank_send_the_same_requests():
    node, rank = FakeEngine(), FakeEngine()
    sched = Scheduler(node, Weights(node, partial=False), PARAMS, seed=3,  # type: ignore[arg-type]
                      slots=None)
    a, _ = asyncio.run(sched.run(ChunkId(4, 1, 2), _prompts(10)))
    b = asyncio.run(engine_rollout(rank, _prompts(10), PARAMS, seed=3, step=4))  # type: ignore[arg-type]
    assert _keyed(node.requests) == _keyed(rank.requests)
    assert [r.seed for r in sorted(rank.requests, key=lambda r: r.request_id)] == [
        request_seed(3, 4, 10), request_seed(3, 4, 11)]
    assert {r.cache_salt for r in node.requests} == {"sft:0"}
    assert {r.cache_salt for r in rank.requests} == {"colocated:0"}
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.behaviour_logprobs, b.behaviour_logprobs)


def test_an_episodes_turns_are_the_same_requests_on_the_node_and_a_colocated_rank():
    spec = EpisodeSpec(make_env=OkEnv, row=lambda p: {"prompt": ""}, render=lambda o: [50, 51],
                       decode=lambda ids: "x", max_turns=2, max_tokens=12, timeout_s=5.0)
    node, rank = FakeEngine(stop_after=3), FakeEngine(stop_after=3)
    sched = Scheduler(node, Weights(node, partial=False), PARAMS, seed=2,  # type: ignore[arg-type]
                      slots=None)
    a, _ = asyncio.run(sched.episodes(ChunkId(1, 0, 1), _prompts(0), spec))
    with_env = dataclasses.replace(PARAMS, episode=spec)
    b = asyncio.run(engine_rollout(rank, _prompts(0), with_env, seed=2, step=1))  # type: ignore[arg-type]
    assert len(node.requests) == 4 and _keyed(node.requests) == _keyed(rank.requests)
    assert sorted(r.request_id for r in rank.requests) == ["1/0/0", "1/0/1", "1/1/0", "1/1/1"]
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.response_mask, b.response_mask)
    assert a.prefill_counts is not None and b.prefill_counts is not None
    assert torch.equal(a.prefill_counts, b.prefill_counts)


def test_the_rest_of_an_aborted_request_continues_it_under_its_next_key():
    params = SamplingParams(max_new_tokens=6, eos_id=99, pad_id=0, min_new_tokens=4,
                            stop_ids=(7,))
    requests = Requests(params, seed=5, step=2, tag="t", version=3, lineage="L")
    (sid, first), = requests.rows(_prompts(8, 2).split(1, 2)[0])
    assert (sid, first.prompt_ids, first.cache_salt) == (8, (5, 6), "L:3")
    rest = requests.rest(first, sid, 0, 1, Completion(first.request_id, [11, 12, 13]))
    assert rest == Request("t/8#1", (5, 6, 11, 12, 13), 3, request_seed(5, 2, 8, 1), 1, (7,),
                           (), "L:3")
