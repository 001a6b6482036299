"""The generator's request scheduler over an engine: one keyed request per row, the rollout
reassembled, the row cap of continuous batching, and an engine that cannot keep requests
across an update (abort, commit, resubmit with the prefix). The engine is a fake that
answers token by token: token i of a sequence is its position (prompt tokens included),
so a resubmitted request visibly continues where it was cut."""

import asyncio

import pytest
import torch

from nodes.generator.inflight import Weights
from nodes.generator.main import _overlapping
from nodes.generator.scheduler import Scheduler
from rlhf_async.engines import Capabilities, Completion, Request
from rlhf_async.modeling.environment import EpisodeSpec
from rlhf_async.modeling.generation import SamplingParams, request_seed
from rlhf_async.modeling.rollout import ENV, POLICY, PromptBatch
from rlhf_async.pipeline.protocol import ChunkId

PAD = 0
PARAMS = SamplingParams(max_new_tokens=6, eos_id=99, pad_id=PAD, min_new_tokens=2)


class FakeEngine:
    name = "fake"

    def __init__(self, keep: bool = True, delay: float = 0.0,
                 stop_after: int | None = None) -> None:
        self.stop_after = stop_after  # a response ends in a stop after this many tokens
        self.capabilities = Capabilities(keep_on_update=keep, stop_strings=True,
                                         prefix_cache=False, tensor_parallel=False)
        self.delay, self._version = delay, 0
        self.requests: list[Request] = []
        self.aborted: set[str] = set()
        self.live = self.peak = 0
        self.started = asyncio.Event()

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, req: Request) -> Completion:
        self.requests.append(req)
        self.live += 1
        self.peak = max(self.peak, self.live)
        self.started.set()
        got = Completion(req.request_id, finish="length")
        try:
            for i in range(req.max_new_tokens):
                if i == self.stop_after:
                    got.finish = "stop"
                    break
                await asyncio.sleep(self.delay)
                if req.request_id in self.aborted:
                    got.finish = "abort"
                    break
                got.token_ids.append(len(req.prompt_ids) + i)
                got.logprobs.append(-0.5)
                got.versions.append(self._version)
            return got
        finally:
            self.live -= 1

    async def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)

    async def commit(self, staged: int) -> int:
        self._version = staged
        return staged


def _prompts(first: int, rows: int = 2) -> PromptBatch:
    ids = torch.tensor([[PAD, 5, 6], [7, 8, 9]] * (rows // 2))
    sids = torch.arange(first, first + rows)
    return PromptBatch(ids, (ids != PAD).long(), sids, sids // 2)


def test_a_chunk_is_one_keyed_request_per_row_reassembled_in_row_order():
    engine = FakeEngine()
    weights = Weights(engine, partial=False)  # type: ignore[arg-type]
    sched = Scheduler(engine, weights, PARAMS, seed=3, slots=None)  # type: ignore[arg-type]
    batch, span = asyncio.run(sched.run(ChunkId(4, 1, 2), _prompts(10)))
    reqs = sorted(engine.requests, key=lambda r: r.request_id)
    assert [r.prompt_ids for r in reqs] == [(5, 6), (7, 8, 9)]  # padding stripped
    assert [r.seed for r in reqs] == [request_seed(3, 4, 10), request_seed(3, 4, 11)]
    assert all(r.max_new_tokens == 6 and r.min_new_tokens == 2 for r in reqs)
    assert batch.response_ids.tolist() == [[2, 3, 4, 5, 6, 7], [3, 4, 5, 6, 7, 8]]
    assert batch.response_mask.sum() == 12 and batch.behaviour_logprobs.sum() == pytest.approx(-6.0)
    assert batch.step == 4 and batch.version == 0 and batch.token_versions is None
    assert span.held == [(0, "sft")] and span.swaps == 0


def test_continuous_batching_keeps_at_most_slots_rows_in_the_engine():
    engine = FakeEngine(delay=0.001)
    weights = Weights(engine, partial=True)  # type: ignore[arg-type]
    sched = Scheduler(engine, weights, PARAMS, seed=0, slots=3)  # type: ignore[arg-type]

    async def main():
        return await asyncio.gather(sched.run(ChunkId(0, 0, 2), _prompts(0, 4)),
                                    sched.run(ChunkId(0, 1, 2), _prompts(4, 4)))

    (a, _), (b, _) = asyncio.run(main())
    assert engine.peak == 3 and len(engine.requests) == 8
    assert a.sample_ids.tolist() == [0, 1, 2, 3] and b.sample_ids.tolist() == [4, 5, 6, 7]
    assert sched.busy_s > 0


def test_without_partial_rollouts_a_commit_waits_for_the_running_chunk():
    engine = FakeEngine(delay=0.002)
    weights = Weights(engine, partial=False)  # type: ignore[arg-type]
    sched = Scheduler(engine, weights, PARAMS, seed=0, slots=None)  # type: ignore[arg-type]

    async def main():
        chunk = asyncio.ensure_future(sched.run(ChunkId(0, 0, 1), _prompts(0)))
        await engine.started.wait()
        version = await weights.commit(7, 7, "L")
        return await chunk, version

    (batch, span), version = asyncio.run(main())
    assert version == 7 and weights.version == 7 and span.swaps == 0
    assert batch.version == 0  # every token from the weights it started with


def test_an_engine_that_cannot_keep_requests_gets_them_back_with_their_prefix():
    engine = FakeEngine(keep=False, delay=0.002)
    weights = Weights(engine, partial=True)  # type: ignore[arg-type]
    sched = Scheduler(engine, weights, PARAMS, seed=1, slots=None)  # type: ignore[arg-type]

    async def main():
        chunk = asyncio.ensure_future(sched.run(ChunkId(2, 0, 1), _prompts(0)))
        while not any(engine.live and r for r in engine.requests) or engine.live < 2:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.005)  # some tokens in
        await weights.commit(5, 5, "L")
        return await chunk

    batch, span = asyncio.run(main())
    # each row continues where it was cut: its tokens are its positions, R of them
    assert batch.response_ids.tolist() == [[2, 3, 4, 5, 6, 7], [3, 4, 5, 6, 7, 8]]
    again = [r for r in engine.requests if "#" in r.request_id]
    assert len(again) == 2
    for r in again:
        first = next(f for f in engine.requests if f.request_id == r.request_id.split("#")[0])
        cut = len(r.prompt_ids) - len(first.prompt_ids)
        assert 0 < cut < 6 and r.max_new_tokens == 6 - cut
        assert r.prompt_ids[: len(first.prompt_ids)] == first.prompt_ids
        assert r.min_new_tokens == max(0, 2 - cut)
        sid = 0 if len(first.prompt_ids) == 2 else 1
        assert r.seed == request_seed(1, 2, sid, 1)  # the next segment's key
    versions = batch.token_versions
    assert versions is not None and set(versions.flatten().tolist()) == {0, 5}
    assert batch.version == 0 and span.held == [(0, "sft"), (5, "L")]
    assert span.lineage() == "L"


def test_a_failing_chunk_ends_the_node_with_its_error():
    async def chunks():
        yield ChunkId(0, 0, 1), _prompts(0)
        await asyncio.sleep(60)

    async def generate(cid, prompts):
        raise RuntimeError("CUDA error: out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        asyncio.run(asyncio.wait_for(_overlapping(chunks(), generate), 10))


class OkEnv:
    async def reset(self, row):
        return ""

    async def step(self, action):
        return "ok", 1.0, False


def test_an_episodes_turns_are_requests_over_the_conversation_so_far():
    engine = FakeEngine(stop_after=3)  # each policy turn: 3 tokens, then a stop
    weights = Weights(engine, partial=False)  # type: ignore[arg-type]
    sched = Scheduler(engine, weights, PARAMS, seed=2, slots=None)  # type: ignore[arg-type]
    spec = EpisodeSpec(make_env=OkEnv, row=lambda p: {"prompt": ""}, render=lambda o: [50, 51],
                       decode=lambda ids: "x", max_turns=2, max_tokens=12, timeout_s=5.0)
    batch, _ = asyncio.run(sched.episodes(ChunkId(1, 0, 1), _prompts(0), spec))
    turn1 = sorted((r for r in engine.requests if r.request_id.endswith("/1")),
                   key=lambda r: r.request_id)
    # the second turn's prompt: the prompt, the first turn, the environment's tokens
    assert turn1[0].prompt_ids == (5, 6, 2, 3, 4, 50, 51)
    assert turn1[0].seed == request_seed(2, 1, 0, turn=1)
    assert batch.response_ids[0, :10].tolist() == [2, 3, 4, 50, 51, 7, 8, 9, 50, 51]
    kinds = [POLICY] * 3 + [ENV] * 2
    assert batch.response_mask[0, :10].tolist() == kinds + kinds
    assert batch.env_rewards is not None and batch.env_rewards.tolist() == [2.0, 2.0]
