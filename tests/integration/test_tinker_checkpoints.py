"""save_weights / load_weights through the Tinker-compatible API with the real `tinker`
client (0.38.0): a training checkpoint in our format under tinker://RUN/weights/NAME, a
new training client from it (with and without AdamW's state), also after the server
restarted on the same state directory."""

from __future__ import annotations

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


def test_after_a_restart_the_client_gets_a_clear_error_not_a_hang(tmp_path: Path,
                                                                 one_thread: None) -> None:
    with running_api(tmp_path) as url:
        port = int(url.rsplit(":", 1)[1])
        service = tinker.ServiceClient(base_url=url, api_key=KEY)
        training = service.create_lora_training_client(base_model=BUILTIN, rank=2,
                                                       seed=0).result()
        data = _data(training.get_tokenizer())
        _step(training, data)
        path = training.save_state("before").result().path
    with running_api(tmp_path, port=port):  # the same address, a new server process state
        with pytest.raises(tinker.NotFoundError, match="server restarted"):
            training.forward_backward(data, "cross_entropy").result(timeout=60)
        # what the error says to do: a new training client from the checkpoint
        again = service.create_training_client_from_state(path)
        with pytest.raises(tinker.NotFoundError, match="unknown session"):
            again.result(timeout=60)  # the old session is gone too
        fresh = tinker.ServiceClient(base_url=url, api_key=KEY)
        resumed = fresh.create_training_client_from_state(path).result()
        assert resumed.forward(data, "cross_entropy").result().metrics["loss:sum"] > 0
