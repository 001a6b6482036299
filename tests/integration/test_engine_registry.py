"""A generation engine is one class and one registry line: `ToyEngine` below, registered by
monkeypatch, generates every rollout of a Separation job (its generator process takes the
line from the coordinator's registry) and of a Flattening one (beside the rank,
`strategies/colocated.py`); each request it answers is written down where it ran. A
training backend is one class and one line too (`CountingBackend`)."""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from rlhf_async import job
from rlhf_async.config import load_config
from rlhf_async.engines import (
    ENGINES,
    TRAINING_BACKENDS,
    Backend,
    Capabilities,
    Completion,
    Engine,
    Prefill,
    Request,
)
from rlhf_async.engines.torch_train import TorchTrainBackend
from rlhf_async.metrics import read_metrics
from rlhf_async.modeling.generation import SamplingParams
from rlhf_async.weight_sync import make_receiver

pytestmark = [pytest.mark.timeout(300)]

LOG = "TOY_ENGINE_LOG"  # where a ToyEngine, in whichever process, writes each request
TINY = ["model.hidden=32", "model.layers=1", "model.heads=2", "sft.steps=30",
        "reward_model.steps=30", "reward_model.heldout_pairs=64", "run.eval_prompts=16",
        "train.steps=2", "train.prompts_per_step=4", "algo.group_size=2", "run.plot=false",
        "run.progress=false", "generation.backend=toy"]


class ToyEngine:
    """A uniform policy over the model's vocabulary (stop tokens barred before
    `min_new_tokens`), each request's tokens drawn from its own seed. It joins the
    weight-sync group and receives every update, serving its version (the weights
    themselves it does not use)."""

    name = "toy"
    capabilities = Capabilities(keep_on_update=True, stop_strings=False, prefix_cache=False,
                                tensor_parallel=False)

    def __init__(self, model_dir: str, params: SamplingParams, *, dtype: str,
                 tensor_parallel: int, sync_backend: str, device: Any) -> None:
        self.vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
        self.receiver = make_receiver(sync_backend, device=torch.device(device))
        self.log, self._version = Path(os.environ[LOG]), 0

    async def generate(self, request: Request) -> Completion:
        rng, stops = random.Random(request.seed), set(request.stop_ids)
        out = Completion(request.request_id, prefill=Prefill.of(len(request.prompt_ids), 0))
        while len(out.token_ids) < request.max_new_tokens:
            early = len(out.token_ids) < request.min_new_tokens
            token = rng.choice([t for t in range(self.vocab) if not (early and t in stops)])
            out.token_ids.append(token)
            out.logprobs.append(-math.log(self.vocab - (len(stops) if early else 0)))
            out.versions.append(self._version)
            if token in stops:
                out.finish = "stop"
                break
        with self.log.open("a") as f:
            f.write(json.dumps({"pid": os.getpid(), "id": request.request_id,
                                "version": self._version}) + "\n")
        return out

    async def abort(self, request_id: str) -> None:
        """(a request ends within its generate call: nothing runs to abort)"""

    async def pause(self) -> None:
        """(see abort)"""

    async def resume(self) -> None:
        """(see abort)"""

    def connect(self, spec: Any, rank: int) -> None:
        self.receiver.connect(spec, rank)

    def stage(self, plan: Mapping[str, Any]) -> int:
        return self.receiver.receive(plan).version

    def stage_tensors(self, tensors: Mapping[str, Tensor], version: int) -> int:
        return version

    async def commit(self, staged: int) -> int:
        self._version = staged
        return staged

    async def sleep(self) -> None:
        """(nothing held to free)"""

    async def wake(self) -> None:
        """(see sleep)"""

    @property
    def version(self) -> int:
        return self._version

    async def close(self) -> None:
        self.receiver.close()


class CountingBackend:
    """The torch training backend, counting its optimizer steps."""

    name = "counting"
    steps = 0

    def __init__(self, module: nn.Module, *, lr: float, weight_decay: float,
                 grad_clip: float) -> None:
        self._torch = TorchTrainBackend(module, lr=lr, weight_decay=weight_decay,
                                        grad_clip=grad_clip)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)

    def step(self) -> float:
        CountingBackend.steps += 1
        return self._torch.step()


@pytest.fixture
def toy(monkeypatch, tmp_path):
    monkeypatch.setitem(ENGINES, "toy", Engine(f"{__name__}:ToyEngine"))  # the line
    log = tmp_path / "requests.jsonl"
    monkeypatch.setenv(LOG, str(log))
    return log


def _run(tmp_path, cache, *overrides: str) -> tuple[list[dict[str, Any]], list[dict]]:
    cfg = load_config(None, [*TINY, f"run.cache_dir={json.dumps(str(cache))}",
                             f"run.output_dir={json.dumps(str(tmp_path))}", "run.name=toy",
                             *overrides])
    job.run(cfg)
    return read_metrics(tmp_path / "toy" / "metrics.jsonl"), [
        json.loads(x) for x in (tmp_path / "requests.jsonl").read_text().splitlines()]


def test_a_toy_engine_generates_every_rollout_of_a_separation_job(tmp_path, cache, toy):
    records, requests = _run(tmp_path, cache, "placement.strategy=separation",
                             "placement.devices=2", "algo.max_staleness=0")
    assert [r["step"] for r in records] == [0, 1]
    # one request per row (4 prompts x 2 responses a step), each in the generator process;
    # step 1's sampled by the weights step 0 trained, which the engine received
    assert len(requests) == 2 * 4 * 2
    assert os.getpid() not in {r["pid"] for r in requests}
    assert sorted(r["version"] for r in requests) == [0] * 8 + [1] * 8


@pytest.mark.parametrize("devices", [1, 2])
def test_a_toy_engine_and_training_backend_run_a_flattening_job(tmp_path, cache, toy,
                                                               monkeypatch, devices):
    """One device: the rank is this process; two: rank processes, which take the lines
    from this one."""
    monkeypatch.setitem(TRAINING_BACKENDS, "counting", Backend(f"{__name__}:CountingBackend"))
    monkeypatch.setattr(CountingBackend, "steps", 0)
    records, requests = _run(tmp_path, cache, "placement.strategy=flattening",
                             f"placement.devices={devices}", "train.backend=counting")
    assert [r["step"] for r in records] == [0, 1]
    assert len(requests) == 2 * 4 * 2
    assert sorted(r["version"] for r in requests) == [0] * 8 + [1] * 8
    pids = {r["pid"] for r in requests}
    assert pids == {os.getpid()} if devices == 1 else len(pids - {os.getpid()}) == 2
    if devices == 1:  # actor and critic, each step (the ranks' count is theirs)
        assert CountingBackend.steps >= 2 * 2
