"""The Tinker-compatible API driven by the real `tinker` client (the pinned SDK, 0.38.0):
sessions, create_model (LoRA and full), get_info, forward_backward / forward, optim_step,
futures, and the API's errors."""

from __future__ import annotations

from pathlib import Path

import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from rlhf_async.ops.tinker.base_models import BUILTIN  # noqa: E402
from tests.tinker_api import KEY, running_api  # noqa: E402

TEXTS = ["the cat sat on the mat", "2+2=4", "hello world"]


@pytest.fixture(autouse=True)
def _no_telemetry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    for var in ("TINKER_API_KEY", "TINKER_BASE_URL"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def api(tmp_path: Path, one_thread: None) -> object:
    with running_api(tmp_path) as url:
        yield url


def _data(tok: object, texts: list[str] = TEXTS) -> list[types.Datum]:
    out = []
    for text in texts:
        ids = tok.encode(text)  # type: ignore[attr-defined]
        out.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                               loss_fn_inputs={"target_tokens": ids[1:],
                                               "weights": [1.0] * (len(ids) - 1)}))
    return out


@pytest.mark.parametrize("rank", [8, 0], ids=["lora", "full"])
def test_a_supervised_loop_lowers_the_loss(api: str, rank: int) -> None:
    service = tinker.ServiceClient(base_url=api, api_key=KEY)
    training = service.create_lora_training_client(base_model=BUILTIN, rank=rank,
                                                   seed=0).result()
    info = training.get_info()
    assert info.model_data.model_name == BUILTIN
    assert info.is_lora == (rank > 0) and info.lora_rank == (rank or None)
    data = _data(training.get_tokenizer())
    losses = []
    for _ in range(8):
        fb = training.forward_backward(data, "cross_entropy")
        step = training.optim_step(types.AdamParams(learning_rate=1e-2))
        result = fb.result()
        assert step.result().metrics["learning_rate:mean"] == pytest.approx(1e-2)
        lps = [o["logprobs"].to_numpy() for o in result.loss_fn_outputs]
        assert [len(lp) for lp in lps] == [len(d.model_input.to_ints()) for d in data]
        # cross_entropy is the weighted sum of the returned log-probs, negated (weights 1)
        assert result.metrics["loss:sum"] == pytest.approx(-sum(lp.sum() for lp in lps),
                                                           rel=1e-4)
        losses.append(result.metrics["loss:sum"])
    assert losses[-1] < 0.7 * losses[0], losses
    service.close("success").result()


def test_forward_only_leaves_the_weights(api: str) -> None:
    service = tinker.ServiceClient(base_url=api, api_key=KEY)
    training = service.create_lora_training_client(base_model=BUILTIN, rank=4, seed=0).result()
    data = _data(training.get_tokenizer())
    first = training.forward(data, "cross_entropy").result().metrics["loss:sum"]
    # gradients of a forward are never applied: an optimizer step after it changes nothing
    training.optim_step(types.AdamParams(learning_rate=1e-1)).result()
    again = training.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert again == pytest.approx(first, rel=1e-6)


def test_an_unknown_base_model_is_the_apis_user_error(api: str) -> None:
    service = tinker.ServiceClient(base_url=api, api_key=KEY)
    with pytest.raises(tinker.RequestFailedError) as e:
        service.create_lora_training_client(base_model="nobody/no-such-model").result()
    assert e.value.category == types.RequestErrorCategory.User
    assert "unknown base_model 'nobody/no-such-model'" in str(e.value)
    assert BUILTIN in str(e.value)


@pytest.mark.parametrize(("loss", "inputs", "config", "message"), [
    ("hinge", {}, None, "unknown loss_fn 'hinge'"),
    ("cross_entropy", {"target_tokens": [1, 2]}, None, "target_tokens must be"),
    ("importance_sampling", {}, None, "needs loss_fn_inputs['logprobs']"),
    ("ppo", {"logprobs": [0.0] * 5, "advantages": [1.0] * 5}, {"clip_low_threshold": 1.5},
     "must bracket 1"),
    ("cross_entropy", {}, {"beta": 1.0}, "unknown key(s) beta"),
], ids=["loss-name", "datum-shape", "missing-input", "clip", "config-key"])
def test_a_bad_request_fails_with_a_user_error(api: str, loss: str, inputs: dict[str, list[float]],
                                               config: dict[str, float] | None,
                                               message: str) -> None:
    service = tinker.ServiceClient(base_url=api, api_key=KEY)
    training = service.create_lora_training_client(base_model=BUILTIN, rank=4, seed=0).result()
    tokens = [10, 11, 12, 13, 14]
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens),
                        loss_fn_inputs={"target_tokens": tokens, **inputs})
    with pytest.raises(tinker.RequestFailedError) as e:
        training.forward_backward([datum], loss, config).result()  # type: ignore[arg-type]
    assert e.value.category == types.RequestErrorCategory.User
    assert message in str(e.value)


def test_a_wrong_key_is_refused(api: str) -> None:
    with pytest.raises(tinker.AuthenticationError, match="wrong API key"):
        tinker.ServiceClient(base_url=api, api_key="tml-not-the-key").create_lora_training_client(
            base_model=BUILTIN).result()


def test_the_client_finds_the_server_from_the_environment(api: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINKER_BASE_URL", api)
    monkeypatch.setenv("TINKER_API_KEY", KEY)
    training = tinker.ServiceClient().create_lora_training_client(base_model=BUILTIN,
                                                                  rank=2).result()
    assert training.get_info().model_id.endswith(":train:0")
