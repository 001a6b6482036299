"""The Tinker API server killed mid-run (SIGKILL, a real `rlhf-async serve --api`
process) and started again on the same state directory and address: the real `tinker`
client's session goes on; a model saved since its last training step resumes as it was;
one that had trained past its checkpoint fails clearly until the client loads it; no
model, checkpoint or saved sampler is lost."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from rlhf_async.ops.tinker.base_models import BUILTIN  # noqa: E402
from rlhf_async.wire.local import free_tcp_port  # noqa: E402
from tests.tinker_api import KEY  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_telemetry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINKER_TELEMETRY", "0")


@contextmanager
def serving(state: Path, port: int) -> Iterator[subprocess.Popen[bytes]]:
    env = {**os.environ, "RLHF_ASYNC_API_KEY": KEY, "OMP_NUM_THREADS": "1",
           "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    log = (state / f"serve-{time.time_ns()}.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "rlhf_async", "serve", "--state-dir",
                             str(state), "--api", f"127.0.0.1:{port}"], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:  # until it answers (a loaded machine takes seconds to import torch)
            assert proc.poll() is None, (state / log.name).read_text()
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/api/v1/healthz",
                                             headers={"X-API-Key": KEY})
                urllib.request.urlopen(req, timeout=2).read()
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not come up"
                time.sleep(0.2)
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
        log.close()


def _data(tok: object) -> list[types.Datum]:
    ids = tok.encode("the cat sat on the mat")  # type: ignore[attr-defined]
    return [types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": ids[1:]})]


def _step(training: object, data: list[types.Datum]) -> None:
    training.forward_backward(data, "cross_entropy").result()  # type: ignore[attr-defined]
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()  # type: ignore[attr-defined]


def _loss(training: object, data: list[types.Datum]) -> float:
    out = training.forward(data, "cross_entropy").result()  # type: ignore[attr-defined]
    return float(out.metrics["loss:sum"])


def test_a_killed_server_restarts_with_its_sessions_models_and_checkpoints(
        tmp_path: Path) -> None:
    port = free_tcp_port()
    url = f"http://127.0.0.1:{port}"
    with serving(tmp_path, port) as proc:
        service = tinker.ServiceClient(base_url=url, api_key=KEY)
        kept = service.create_lora_training_client(base_model=BUILTIN, rank=4, seed=0).result()
        data = _data(kept.get_tokenizer())
        _step(kept, data)
        kept_path = kept.save_state("kept").result().path
        kept_loss = _loss(kept, data)  # a forward changes nothing: still as saved
        # what its next step gives, from a twin of the checkpoint (with AdamW's state)
        twin = service.create_training_client_from_state_with_optimizer(kept_path).result()
        _step(twin, data)
        next_loss = _loss(twin, data)
        ahead = service.create_lora_training_client(base_model=BUILTIN, rank=2, seed=1).result()
        _step(ahead, data)
        saved = ahead.save_state("one").result().path
        saved_loss = _loss(ahead, data)
        _step(ahead, data)  # trained past its checkpoint: this step dies with the server
        sampler_path = ahead.save_weights_for_sampler("s1").result().path
        sampler = service.create_sampling_client(model_path=sampler_path).result()
        prompt = types.ModelInput.from_ints(data[0].model_input.to_ints()[:4])
        params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=3)
        before = sampler.sample(prompt, 1, params).result().sequences[0].tokens
        # requests in flight when the server dies: a long sample, a long forward_backward
        busy = service.create_lora_training_client(base_model=BUILTIN, rank=2).result()
        long_row = list(range(3, 250)) * 4
        in_flight_fb = busy.forward_backward([types.Datum(
            model_input=types.ModelInput.from_ints(long_row),
            loss_fn_inputs={"target_tokens": long_row})] * 8, "cross_entropy")
        in_flight_sample = sampler.sample(prompt, 2, types.SamplingParams(
            max_tokens=500, temperature=1.0, stop=[], seed=5))
        time.sleep(1.0)  # most likely accepted by then; either way neither may hang
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    with serving(tmp_path, port):
        # the sample is sent again by the client (410 for its lost future) and completes
        assert [len(s.tokens) for s in in_flight_sample.result(timeout=300).sequences] == \
            [500, 500]
        # the training request's future is gone: said, naming the restart (or, had the
        # kill come before the server took it, the client sent it again and it ran)
        try:
            in_flight_fb.result(timeout=300)
        except ValueError as e:
            assert "server restarted" in str(e)
        # the saved model resumes where it was, on the client's own seq_ids
        assert _loss(kept, data) == pytest.approx(kept_loss, rel=1e-6)
        _step(kept, data)
        assert _loss(kept, data) == pytest.approx(next_loss, rel=1e-6)
        # the one that had trained past its checkpoint says so, and what to do
        with pytest.raises(tinker.RequestFailedError, match="trained past its last checkpoint"):
            _loss(ahead, data)
        with pytest.raises(tinker.RequestFailedError, match="training_client_from_state"):
            _step(ahead, data)  # every request, not only the first
        resumed = service.create_training_client_from_state_with_optimizer(saved).result()
        assert _loss(resumed, data) == pytest.approx(saved_loss, rel=1e-6)
        # a sampling client on saved weights samples as before
        again = sampler.sample(prompt, 1, params).result().sequences[0].tokens
        assert again == before
        # the session goes on: a new model in it
        third = service.create_lora_training_client(base_model=BUILTIN, rank=2).result()
        assert third.get_info().lora_rank == 2
        service.close("success").result()
