"""Tensor-parallel vLLM generators: what `run` accepts and refuses, the processes and
environment each generator gets, and the broadcast group every TP worker joins."""

import asyncio
import importlib.machinery
import importlib.util

import pytest

from rlhf_async.config import load_config
from rlhf_async.pipeline.protocol import WeightSyncConnect, WeightSyncPrepare
from rlhf_async.runtime.messages import Command, decode_reply, to_payload
from rlhf_async.strategies.placement import PlacementError
from rlhf_async.strategies.registry import runnable_placement
from rlhf_async.strategies.separation.clients import (
    GeneratorClient,
    TrainerClient,
    connect_weight_sync,
)
from rlhf_async.strategies.separation.runner import build_specs
from rlhf_async.strategies.separation.startup import generator_ranks
from rlhf_async.task.artefacts import Artefacts
from rlhf_async.weight_sync import GroupSpec

# 8 GPUs: a 2-rank trainer, three generators of 2 GPUs each, scorers sharing them
TP2 = ["placement.strategy=separation", "placement.device=cuda", "placement.devices=8",
       "placement.actor=[0,1]", "generation.backend=vllm",
       'placement.tensor_parallel=["shadow_actor=2"]']


@pytest.fixture(autouse=True)
def engines_installed(monkeypatch):
    """Planning a vLLM (or Ray) job needs neither here: the config only checks they exist."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: importlib.machinery
                        .ModuleSpec(name, None) if name in ("vllm", "ray") else real(name, *a))


def test_vllm_generators_run_tensor_parallel_on_every_device(tmp_path, monkeypatch):
    cfg = load_config(None, TP2)
    p = runnable_placement(cfg)
    assert generator_ranks(p) == 2
    gens = p.by_role("generator")
    assert [len(g.devices) for g in gens] == [2, 2, 2]
    used = {d for q in p.processes for d in q.devices}
    assert used == set(range(8))  # every device works
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7,6,5,4,3,2,1,0")  # this job's own GPUs
    art = Artefacts(tmp_path / "sft", None, {}, {})
    specs = {s.node_id: s for s in build_specs(cfg, art, tmp_path, p, "/tmp/x")[0]}
    for g in gens:
        spec = specs[g.node_id]
        assert spec.params["tensor_parallel"] == 2 and spec.device == "cuda:0"
        # vLLM's workers see the generator's two GPUs, named as the parent names them
        want = ",".join(str(7 - d) for d in g.devices)
        assert spec.env["CUDA_VISIBLE_DEVICES"] == want
    assert "tensor_parallel" not in specs["scorer0"].params
    assert "CUDA_VISIBLE_DEVICES" not in specs["trainer"].env


def test_tensor_parallel_generators_need_vllm_and_the_local_launcher():
    with pytest.raises(PlacementError) as e:
        runnable_placement(load_config(None, [*TP2, "generation.backend=torch"]))
    assert ("placement.tensor_parallel: shadow_actor=2 is not run by this build's runners "
            "(they keep whole copies; tensor-parallel generators need an engine that spans "
            "devices (generation.backend = 'vllm')); use 1") in e.value.problems
    with pytest.raises(PlacementError) as e:
        runnable_placement(load_config(None, [*TP2, "placement.launcher=ray"]))
    assert any("runs with the local launcher only" in p for p in e.value.problems)
    with pytest.raises(PlacementError) as e:  # a scorer is still one GPU's work
        runnable_placement(load_config(None, [*TP2, 'placement.tensor_parallel=["reward=2"]']))
    assert any(p.startswith("placement.tensor_parallel: reward=2 is not run")
               for p in e.value.problems)


class Coord:
    def __init__(self) -> None:
        self.commands: list[tuple[str, Command]] = []

    async def call(self, node_id: str, cmd: Command, timeout: float = 10.0):
        self.commands.append((node_id, cmd))
        if isinstance(cmd, WeightSyncPrepare):
            return decode_reply(cmd, to_payload(cmd.spec))
        return decode_reply(cmd, {"group": "actor@0"})


def test_every_tensor_parallel_worker_is_a_rank_of_the_broadcast_group():
    coord = Coord()
    spec = GroupSpec("nccl", "10.0.0.1", 0, 2, timeout_s=5)
    gens = [GeneratorClient(coord, g) for g in ("gen0", "gen1")]  # type: ignore[arg-type]
    out = asyncio.run(connect_weight_sync(TrainerClient(coord), gens, spec, 2))  # type: ignore[arg-type]
    assert out.world_size == 5  # the trainer and two workers of each generator
    assert out.peers == ("trainer", "gen0 worker 0", "gen0 worker 1", "gen1 worker 0",
                         "gen1 worker 1")
    first = {node: c.rank for node, c in coord.commands
             if isinstance(c, WeightSyncConnect) and node != "trainer"}
    assert first == {"gen0": 1, "gen1": 3}  # worker w of a generator joins as first + w


def test_on_cpus_each_vllm_worker_is_bound_to_its_slots_core(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    cfg = load_config(None, ["placement.strategy=separation", "placement.devices=3",
                             "placement.generator=[1,2]", "placement.scorers=1",
                             "generation.backend=vllm",
                             'placement.tensor_parallel=["shadow_actor=2"]'])
    p = runnable_placement(cfg)
    art = Artefacts(tmp_path / "sft", None, {}, {})
    specs = {s.node_id: s for s in build_specs(cfg, art, tmp_path, p, "/tmp/x")[0]}
    # vllm-cpu binds a worker per NUMA node, which a 2-core box has one of: one core each
    assert specs["gen0"].env["VLLM_CPU_OMP_THREADS_BIND"] == "1|0"
    assert specs["gen0"].params["tensor_parallel"] == 2
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1|0-1")  # the user's own binding
    specs = {s.node_id: s for s in build_specs(cfg, art, tmp_path, p, "/tmp/x")[0]}
    assert "VLLM_CPU_OMP_THREADS_BIND" not in specs["gen0"].env
