"""The simulated devices' parts without processes: the phase prices (the cost model's own
arithmetic), the virtual batch's time (advanced by hand: no clock), and the sim engine's
requests over a tiny real model (log-probs as the trainer recomputes them, versions across
a commit, pause, abort). No verdict rests on wall-clock time."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from rlhf_async.config import JobConfig, ModelConfig, load_config
from rlhf_async.engines import ENGINES, engine_choice, make_training_backend
from rlhf_async.engines.interface import Request
from rlhf_async.engines.sim import SimSpec, simulate
from rlhf_async.engines.sim.batch import Row, VirtualBatch
from rlhf_async.engines.sim.engine import SimEngine
from rlhf_async.engines.sim.metrics import SimulatedTime
from rlhf_async.engines.sim.train import SimTrainBackend
from rlhf_async.modeling.generation import SamplingParams
from rlhf_async.modeling.models import load_actor, response_logits
from rlhf_async.modeling.roofline import DEVICES, LLAMA, Calibration
from rlhf_async.planning.costmodel import Workload, _train_times, memory_plan, train_collectives
from rlhf_async.rl.algorithms import gather_logprobs
from rlhf_async.strategies.registry import plan_placement

SIM = ["placement.strategy=separation", "placement.device=sim", "placement.devices=8",
       "train.backend=sim", "train.prompts_per_step=64", "algo.group_size=2"]


def _spec(**kw) -> SimSpec:
    base = SimSpec(LLAMA["7B"], DEVICES["H100"], Calibration(), 1.0, 8, 512, 480, "fixed",
                   128, 1, 4)
    return dataclasses.replace(base, **kw)


def test_phase_prices_are_the_roofline_by_hand():
    s, p, cal = _spec(), 6.7e9, Calibration()
    fixed = 32 * cal.gen_call_s
    assert s.prefill_s(1) == pytest.approx(max(2 * p * 512 / (989e12 * 0.5),
                                               2 * p / (3.35e12 * 0.7)) + fixed)
    kv = 2 * 32 * 4096 * 2 * 700  # 700 tokens of bf16 keys and values in 32 layers
    assert s.decode_s(1, 700) == pytest.approx((2 * p + kv) / (3.35e12 * 0.7) + fixed)
    # 7B's training states (2 x 16 B/param) overflow an 80 GB H100: ZeRO-3 over ranks
    assert s.zero3(4) and not s.zero3(1)
    # 8 GPUs share one node's NVLink; 16 reach across nodes through the NIC
    assert s.broadcast_s() == pytest.approx(2 * p / (450e9 * 0.7) + cal.collective_s)
    assert dataclasses.replace(s, devices=16).broadcast_s() == pytest.approx(
        2 * p / (50e9 * 0.7) + cal.collective_s)


def test_the_cost_model_prices_training_as_the_sim_backend_sleeps_it():
    """Separation's trainer group in the cost model and a sim trainer rank: one number."""
    cfg = load_config(None, [*SIM, "placement.actor=[0,1,2,3]", "placement.generators=2",
                             "placement.scorers=2", "algo.name=grpo"])
    # priced in bf16 as the simulated GPUs hold it (the stand-in models here stay fp32)
    placement = plan_placement(dataclasses.replace(cfg.placement, dtype=["bf16"]),
                               cfg.algo.name)
    spec = SimSpec.of(cfg)
    w = Workload(spec.samples, 512, 480, spec.epochs, spec.minibatches, False)
    _, zero3 = memory_plan(placement, spec.shape, spec.device)
    busy = _train_times(placement, spec.shape, w, spec.device, spec.cal, zero3)
    collectives = train_collectives(w) * spec.cal.collective_s
    assert busy[0] == pytest.approx(spec.train_step_s(4) + collectives)


def test_virtual_batch_ends_rows_at_the_priced_time_however_time_is_cut():
    spec = _spec()
    whole, cut = VirtualBatch(spec), VirtualBatch(spec)
    for b in (whole, cut):
        b.add(Row("a", 3))
        b.add(Row("b", 5))
    first = whole.until_next_end()
    by_hand = spec.prefill_s(2) + sum(spec.decode_s(2, 2 * 512 + 2 * i) for i in range(3))
    assert first == pytest.approx(by_hand)
    assert [r.rid for r in whole.advance(first * (1 + 1e-9), 0)] == ["a"]
    ended = []
    for _ in range(100):  # the same time in 100 slices: a step in progress is kept
        ended += cut.advance(first * (1 + 1e-9) / 100, 0)
    assert [(r.rid, r.done) for r in ended] == [("a", 3)]
    assert cut.running.keys() == whole.running.keys() == {"b"}
    assert cut.running["b"].done == whole.running["b"].done == 3


def test_virtual_batch_keeps_rows_beyond_the_kv_cache_waiting():
    spec = _spec(device=dataclasses.replace(DEVICES["H100"], memory=16e9))
    assert spec.max_rows == 1  # 7B's 13.4 GB of weights leave one row's KV cache
    b = VirtualBatch(spec)
    b.add(Row("a", 2))
    b.add(Row("b", 2))
    assert list(b.running) == ["a"] and [r.rid for r in b.waiting] == ["b"]
    ended = b.advance(b.until_next_end() * (1 + 1e-9), 0)
    assert [r.rid for r in ended] == ["a"] and list(b.running) == ["b"]


def test_tokens_carry_the_version_that_decoded_them():
    b = VirtualBatch(_spec())
    b.add(Row("c", 10))
    b.advance(b.until_next_end() / 2, 3)
    r = b.running["c"]
    first = r.done
    assert [r.rid for r in b.advance(b.until_next_end() * 2, 4)] == ["c"]
    assert r.versions == [[3, first], [4, 10 - first]] and 0 < first < 10
    assert r.version_at(0.0) == 3 and r.version_at(0.99) == 4


def test_long_tail_lengths_are_keyed_and_have_the_mean():
    spec = _spec(lengths="long_tail")
    lengths = [spec.response_length(seed) for seed in range(4000)]
    assert lengths[:50] == [spec.response_length(seed) for seed in range(50)]
    assert sum(lengths) / len(lengths) == pytest.approx(480, rel=0.08)
    assert max(lengths) <= 8 * 480 and min(lengths) >= 1


def test_a_sim_job_chooses_the_sim_engine_and_a_real_one_refuses_it():
    cfg = load_config(None, SIM)
    assert engine_choice(cfg)[0] == "sim" and "sim" in ENGINES
    from rlhf_async.config import ConfigError
    with pytest.raises(ConfigError) as e:
        load_config(None, ["placement.device=sim"])
    assert any("train.backend" in p for p in e.value.problems)
    with pytest.raises(ConfigError) as e:
        load_config(None, ["generation.backend=sim"])
    assert any("simulated devices only" in p for p in e.value.problems)


def test_step_records_are_rescaled_to_simulated_seconds():
    hook = SimulatedTime(0.01)
    record = {"time_step": 0.5, "samples_per_s": 200.0, "weight_sync_s": 0.01}
    hook(record)
    assert record["time_step"] == pytest.approx(50.0)
    assert record["samples_per_s"] == pytest.approx(2.0)
    assert record["weight_sync_s"] == pytest.approx(1.0)
    assert record["real/time_step"] == 0.5 and record["control/real_s"] >= 0.0


# --- the engine over a tiny real model -------------------------------------------------

PARAMS = SamplingParams(max_new_tokens=8, eos_id=2, pad_id=0, temperature=0.7)


def _engine(scale: float, clock=None) -> SimEngine:
    actor = load_actor(ModelConfig(hidden=16, layers=1, heads=2), 32, (0, 1, 2), seed=0)
    return SimEngine("", PARAMS, module=actor, spec=_spec(time_scale=scale), clock=clock)


def _request(rid: str, seed: int) -> Request:
    return Request(rid, (1, 5, 6, 7), 8, seed)


def test_engine_log_probs_are_what_the_trainer_recomputes():
    engine = _engine(1e-5)

    async def go():
        done = await asyncio.gather(*(engine.generate(_request(f"r{i}", i)) for i in range(3)))
        await engine.close()
        return done
    done = asyncio.run(go())
    for c in done:
        assert len(c.token_ids) == 8 and c.finish == "length" and c.versions == [0] * 8
        ids = torch.tensor([c.token_ids])
        logits = response_logits(engine.module, torch.tensor([[1, 5, 6, 7]]),
                                 torch.ones(1, 4, dtype=torch.long), ids, torch.ones_like(ids))
        again = gather_logprobs(logits, ids, PARAMS.temperature)[0]
        assert torch.allclose(again, torch.tensor(c.logprobs), atol=1e-5)
    assert len({tuple(c.token_ids) for c in done}) == 3  # keyed by each request's seed


def test_engine_commit_mid_request_abort_and_pause():
    """Time is the test's: the engine's clock moves only when told (its own wake-ups find
    no time passed)."""
    now = [0.0]
    engine = _engine(1.0, clock=lambda: now[0])
    one = VirtualBatch(_spec())
    one.add(Row("x", 480))
    whole = one.until_next_end()  # one row's simulated seconds, prefill included

    async def go():
        running = asyncio.ensure_future(engine.generate(_request("a", 1)))
        await asyncio.sleep(0)
        now[0] += whole / 2
        weights = {k: v + 0.01 for k, v in engine.module.state_dict().items()}
        assert await engine.commit(engine.stage_tensors(weights, 7)) == 7
        half = engine.batch.running["a"].done
        now[0] += whole
        await engine.resume()  # (not paused: it only brings the batch up to now)
        committed = await running
        cut = asyncio.ensure_future(engine.generate(_request("b", 2)))
        await asyncio.sleep(0)
        now[0] += whole / 4
        await engine.pause()
        row = engine.batch.running["b"]
        before = row.done
        now[0] += 10 * whole  # paused: no step happens
        await engine.resume()
        assert row.done == before and 0 < before < 480
        await engine.abort("b")
        aborted = await cut
        await engine.close()
        return committed, aborted, half
    committed, aborted, half = asyncio.run(go())
    assert 0 < half < 480
    assert committed.versions[0] == 0 and committed.versions[-1] == 7
    assert aborted.finish == "abort" and 0 < len(aborted.token_ids) < 8


def test_sim_backend_trains_the_real_module_and_sleeps_the_rest():
    actor = load_actor(ModelConfig(hidden=16, layers=1, heads=2), 32, (0, 1, 2), seed=0)
    backend = SimTrainBackend(actor, lr=1e-2, weight_decay=0.0, grad_clip=1.0,
                              spec=_spec(time_scale=1e-6), ranks=2)
    before = {k: v.clone() for k, v in actor.state_dict().items()}
    ids = torch.tensor([[1, 5, 6, 7]])
    backend.backward(actor(input_ids=ids).logits.square().mean())
    assert torch.isfinite(torch.tensor(backend.step()))
    assert any(not torch.equal(before[k], v) for k, v in actor.state_dict().items())
    assert backend.update_s == pytest.approx(_spec().train_step_s(2) / 4)
    assert [set(g) for g in backend.iter_weight_groups(1 << 20)] == [set(before)]


def test_make_training_backend_builds_the_sim_one_in_a_sim_node():
    cfg: JobConfig = load_config(None, SIM)
    assert simulate(cfg) is not None
    actor = load_actor(ModelConfig(hidden=16, layers=1, heads=2), 32, (0, 1, 2), seed=0)
    backend = make_training_backend("sim", actor, lr=1e-3, weight_decay=0.0, grad_clip=1.0)
    assert backend.name == "sim"
