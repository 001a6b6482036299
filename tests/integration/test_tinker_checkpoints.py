"""save_weights / load_weights through the Tinker-compatible API with the real `tinker`
client (0.38.0): a training checkpoint in our format under tinker://RUN/weights/NAME, a
new training client from it (with and without AdamW's state), also after the server
restarted on the same state directory."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from rlhf_async.ops.tinker.base_models import BUILTIN  # noqa: E402
from tests.tinker_api import KEY, running_api  # noqa: E402


@pytest.fixture(autouse=True)
def _no_telemetry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINKER_TELEMETRY", "0")


def _data(tok: object) -> list[types.Datum]:
    ids = tok.encode("the cat sat on the mat")  # type: ignore[attr-defined]
    return [types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": ids[1:]})]


def _step(training: object, data: list[types.Datum]) -> float:
    fb = training.forward_backward(data, "cross_entropy")  # type: ignore[attr-defined]
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()  # type: ignore[attr-defined]
    return float(fb.result().metrics["loss:sum"])


def test_a_checkpoint_resumes_training_exactly(tmp_path: Path, one_thread: None) -> None:
    with running_api(tmp_path) as url:
        service = tinker.ServiceClient(base_url=url, api_key=KEY)
        training = service.create_lora_training_client(base_model=BUILTIN, rank=4,
                                                       seed=0).result()
        data = _data(training.get_tokenizer())
        for _ in range(3):
            _step(training, data)
        path = training.save_state("three").result().path
        assert path.endswith("/weights/three")
        with pytest.raises(tinker.RequestFailedError, match="exists; pass overwrite"):
            training.save_state("three").result()
        resumed = service.create_training_client_from_state_with_optimizer(path).result()
        assert resumed.get_info().lora_rank == 4
        service.close("success").result()
    # the server restarts on the same state directory: the checkpoint is still there
    with running_api(tmp_path) as url:
        service = tinker.ServiceClient(base_url=url, api_key=KEY)
        a = service.create_training_client_from_state_with_optimizer(path).result()
        b = service.create_training_client_from_state_with_optimizer(path).result()
        original_next = [_step(a, data) for _ in range(2)]
        assert [_step(b, data) for _ in range(2)] == pytest.approx(original_next, rel=1e-6)
        fresh_opt = service.create_training_client_from_state(path).result()
        first = fresh_opt.forward(data, "cross_entropy").result().metrics["loss:sum"]
        assert first == pytest.approx(original_next[0], rel=1e-5)  # the same weights
        # without AdamW's moments the same lr takes a different step
        assert _step(fresh_opt, data) == pytest.approx(original_next[0], rel=1e-5)
        assert _step(fresh_opt, data) != pytest.approx(original_next[1], rel=1e-4)
        with pytest.raises(tinker.BadRequestError, match="no checkpoint"):
            service.create_training_client_from_state("tinker://nobody/weights/x").result()
        service.close("success").result()


def _retrieve(url: str, request_id: str) -> tuple[int, str]:
    return _post(url, "retrieve_future", {"request_id": request_id})


def _post(url: str, path: str, body: dict[str, str]) -> tuple[int, str]:
    req = urllib.request.Request(f"{url}/api/v1/{path}", method="POST",
                                 data=json.dumps(body).encode(),
                                 headers={"X-API-Key": KEY, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_after_a_restart_lost_futures_say_so_and_models_come_back(tmp_path: Path,
                                                                 one_thread: None) -> None:
    with running_api(tmp_path) as url:
        port = int(url.rsplit(":", 1)[1])
        service = tinker.ServiceClient(base_url=url, api_key=KEY)
        training = service.create_lora_training_client(base_model=BUILTIN, rank=2,
                                                       seed=0).result()
        data = _data(training.get_tokenizer())
        _step(training, data)
        fresh = service.create_lora_training_client(base_model=BUILTIN, rank=2,
                                                    seed=5).result()
        _step(fresh, data)  # never saved: lost with the server
        untouched = service.create_lora_training_client(base_model=BUILTIN, rank=3,
                                                        seed=5).result()
        untouched_loss = untouched.forward(data, "cross_entropy").result().metrics["loss:sum"]
    with running_api(tmp_path, port=port):  # the same address and state directory
        # a training request's future is gone: the client is told, not left polling
        status, body = _retrieve(url, "0123abcd")
        assert status == 404 and "server restarted" in body
        # a sample's is 410, which the client answers by sending the sample again
        status, body = _retrieve(url, "s-0123abcd")
        assert status == 410 and "send it again" in body
        # never saved, trained since: said, with what to do
        with pytest.raises(tinker.RequestFailedError, match="never saved"):
            fresh.forward(data, "cross_entropy").result(timeout=60)
        # a model never trained comes back as created (its LoRA from its seed)
        assert untouched.get_info().lora_rank == 3
        assert untouched.forward(data, "cross_entropy").result().metrics["loss:sum"] == \
            pytest.approx(untouched_loss, rel=1e-6)
        service.close("success").result()


def test_a_finished_sessions_models_let_go_and_its_checkpoints_stay(tmp_path: Path,
                                                                   one_thread: None) -> None:
    with running_api(tmp_path) as url:
        service = tinker.ServiceClient(base_url=url, api_key=KEY)
        training = service.create_lora_training_client(base_model=BUILTIN, rank=2,
                                                       seed=0).result()
        data = _data(training.get_tokenizer())
        _step(training, data)
        path = training.save_state("end").result().path
        loss = training.forward(data, "cross_entropy").result().metrics["loss:sum"]
        model_id = training.get_info().model_id
        service.close("success").result()  # the client refuses calls after this
        # its model no longer serves (its memory is freed), and says why
        status, body = _post(url, "get_info", {"model_id": model_id})
        assert status == 410 and "has finished" in body
        again = tinker.ServiceClient(base_url=url, api_key=KEY)
        resumed = again.create_training_client_from_state(path).result()
        assert resumed.forward(data, "cross_entropy").result().metrics["loss:sum"] == \
            pytest.approx(loss, rel=1e-6)
