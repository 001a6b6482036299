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


def test_forward_backward_custom_trains_as_the_built_in_loss(api: str) -> None:
    """The client's forward_backward_custom (a forward, the loss and its gradient on the
    client, a backward with weights = -dloss/dlp) on this server: an importance-sampling
    loss written by hand gives the built-in's value and the same update."""
    torch = pytest.importorskip("torch")
    service = tinker.ServiceClient(base_url=api, api_key=KEY)
    built_in, custom = (service.create_lora_training_client(base_model=BUILTIN, rank=4,
                                                            seed=2).result() for _ in range(2))
    tokens = built_in.get_tokenizer().encode("2+2=4, 3+3=6")
    n = len(tokens) - 1
    q = [-5.0 - 0.1 * (i % 4) for i in range(n)]
    adv = [1.0 if i % 3 else -0.5 for i in range(n)]
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": q,
                                        "advantages": adv})

    def is_loss(data: list[types.Datum], lps: list[object]) -> tuple[object, dict[str, float]]:
        loss = sum((-torch.exp(lp - torch.tensor(d.loss_fn_inputs["logprobs"].data))
                    * torch.tensor(d.loss_fn_inputs["advantages"].data)).sum()
                   for d, lp in zip(data, lps, strict=True))
        return loss, {"is_loss": float(loss)}

    want = built_in.forward_backward([datum], "importance_sampling").result()
    got = custom.forward_backward_custom([datum], is_loss).result()
    assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-5)
    assert got.metrics["is_loss"] == pytest.approx(want.metrics["loss:sum"], rel=1e-5)
    for client in (built_in, custom):
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = [c.forward([datum], "importance_sampling").result().metrics["loss:sum"]
             for c in (built_in, custom)]
    assert after[1] == pytest.approx(after[0], rel=1e-4)
    assert after[0] != pytest.approx(want.metrics["loss:sum"], rel=1e-4)  # a step was taken
