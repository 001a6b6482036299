"""A training client's model behind the Tinker API (ops/tinker/training.py) on the built-in
tiny model: returned log-probs, gradients summed over forward_backward calls until
optim_step, and AdamW with the request's hyperparameters, by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from rlhf_async.ops.tinker.base_models import BUILTIN, resolve
from rlhf_async.ops.tinker.futures import UserError
from rlhf_async.ops.tinker.proto import Datum
from rlhf_async.ops.tinker.training import Lora, TrainedModel


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> object:
    return resolve(BUILTIN, tmp_path_factory.mktemp("models"))


def _datum(tokens: list[int], weights: list[float] | None = None) -> Datum:
    targets = np.array([*tokens[1:], tokens[0]], dtype=np.int64)
    inputs = {"target_tokens": targets}
    if weights is not None:
        inputs["weights"] = np.array(weights, dtype=np.float32)
    return Datum(tokens, inputs)


DATA = [_datum([40, 41, 42, 43, 44]), _datum([60, 61, 62], [1.0, 0.0, 2.0])]


def test_logprobs_are_the_models_own(base: object, one_thread: None) -> None:
    model = TrainedModel(base, Lora(0, 0), torch.device("cpu"))  # type: ignore[arg-type]
    outputs, metrics = model.forward_backward(DATA, "cross_entropy", {}, forward_only=True)
    for datum, out in zip(DATA, outputs, strict=True):
        with torch.no_grad():
            logits = model.model(input_ids=torch.tensor([datum.tokens])).logits[0]
        want = torch.log_softmax(logits, -1).gather(
            -1, torch.from_numpy(datum.inputs["target_tokens"])[:, None]).squeeze(-1)
        assert out["logprobs"] == pytest.approx(want.numpy(), abs=1e-5)
    weights = [np.ones(5), DATA[1].inputs["weights"]]
    assert metrics["loss:sum"] == pytest.approx(
        -sum(float((o["logprobs"] * w).sum()) for o, w in zip(outputs, weights, strict=True)),
        rel=1e-5)
    assert all(p.grad is None for p in model.params)  # forward_only: no gradient


@pytest.mark.parametrize("rank", [0, 4])
def test_chunked_forward_backward_sums_gradients(base: object, rank: int,
                                                 one_thread: None) -> None:
    whole = TrainedModel(base, Lora(rank, 3), torch.device("cpu"))  # type: ignore[arg-type]
    parts = TrainedModel(base, Lora(rank, 3), torch.device("cpu"))  # type: ignore[arg-type]
    whole.forward_backward(DATA, "cross_entropy", {}, forward_only=False)
    for d in DATA:  # as the client's chunks arrive: one request each
        parts.forward_backward([d], "cross_entropy", {}, forward_only=False)
    for a, b in zip(whole.params, parts.params, strict=True):
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4)
    if rank:
        assert whole.trainable < sum(p.numel() for p in whole.model.parameters()) / 2


def test_optim_step_is_adamw_with_the_requests_hyperparameters(base: object,
                                                              one_thread: None) -> None:
    model = TrainedModel(base, Lora(0, 0), torch.device("cpu"))  # type: ignore[arg-type]
    model.forward_backward(DATA, "cross_entropy", {}, forward_only=False)
    before = [p.detach().clone() for p in model.params]
    grads = [p.grad.clone() for p in model.params]  # type: ignore[union-attr]
    norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
    lr, wd, eps, clip = 0.01, 0.1, 1.0, norm / 4
    metrics = model.optim_step(lr, 0.5, 0.75, eps, wd, clip)
    assert metrics["grad_norm:mean"] == pytest.approx(norm, rel=1e-5)
    # Adam's first step: m_hat = g, v_hat = g^2, so p <- p (1 - lr wd) - lr g / (|g| + eps),
    # with g clipped to a global norm of `clip` (4x smaller)
    for p0, g, p in zip(before, grads, model.params, strict=True):
        gc = g * (clip / norm)
        torch.testing.assert_close(p.detach(), p0 * (1 - lr * wd) - lr * gc / (gc.abs() + eps),
                                   atol=1e-6, rtol=1e-5)
        assert p.grad is None  # the next forward_backward starts from zero
    assert model.optimizer is not None
    assert model.optimizer.param_groups[0]["betas"] == (0.5, 0.75)


@pytest.mark.parametrize(("datum", "message"), [
    (Datum([], {}), "model_input has no tokens"),
    (Datum([1, 2], {}), "needs 'target_tokens'"),
    (Datum([1, 99999], {"target_tokens": np.array([1, 2])}), "outside the vocabulary"),
    (Datum([1, 2], {"target_tokens": np.array([1.0, 2.0], dtype=np.float32)}), "must be 2 ints"),
    (Datum(list(range(5)) * 300, {"target_tokens": np.zeros(1500, dtype=np.int64)}),
     "1500 tokens; rlhf-async/tiny-gpt2 takes at most 1024"),
])
def test_a_wrong_datum_is_a_user_error(base: object, datum: Datum, message: str) -> None:
    model = TrainedModel(base, Lora(0, 0), torch.device("cpu"))  # type: ignore[arg-type]
    with pytest.raises(UserError, match=message):
        model.forward_backward([datum], "cross_entropy", {}, forward_only=False)


def test_the_builtin_model_is_made_once_and_tokenizes_any_text(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    first = resolve(BUILTIN, tmp_path)
    mtime = (first.path / "config.json").stat().st_mtime_ns
    again = resolve(BUILTIN, tmp_path)
    assert again.path == first.path and (first.path / "config.json").stat().st_mtime_ns == mtime
    tok = AutoTokenizer.from_pretrained(first.tokenizer_id)
    text = "Ünïcode 2+2=4 ✓"
    assert tok.decode(tok.encode(text)) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(UserError, match="unknown base_model 'no/such-model'"):
        resolve("no/such-model", tmp_path)


def _rl_datum(tokens: list[int], q: list[float], adv: list[float]) -> Datum:
    d = _datum(tokens)
    d.inputs["logprobs"] = np.array(q, dtype=np.float32)
    d.inputs["advantages"] = np.array(adv, dtype=np.float32)
    return d


# d(per-token loss)/d(lp) by the API docs' formulas, r = exp(lp - q):
#   importance_sampling -r*A          -> -r*A
#   ppo  -min(r*A, clip(r)*A)         -> -r*A where the unclipped term is the min, else 0
#   cispo -sg(clip(r))*lp*A           -> -clip(r)*A
#   dro  -(lp*A - beta/2*(lp-q)^2)    -> -(A - beta*(lp-q))
def _dloss_dlp(name: str, lp: np.ndarray, q: np.ndarray, a: np.ndarray) -> np.ndarray:
    r = np.exp(lp - q)
    if name == "importance_sampling":
        return -r * a
    if name == "ppo":
        return np.where(r * a <= np.clip(r, 0.8, 1.2) * a, -r * a, 0.0)
    if name == "cispo":
        return -np.clip(r, 0.0, 4.0) * a
    return -(a - 0.05 * (lp - q))


@pytest.mark.parametrize("name", ["importance_sampling", "ppo", "cispo", "dro"])
def test_each_rl_loss_backpropagates_its_own_gradient_through_the_model(
        base: object, name: str, one_thread: None) -> None:
    """The parameter gradient of an RL loss is the chain rule through the returned
    log-probs: equal to cross_entropy's with weights = -dloss/dlp (hand formula)."""
    rl = TrainedModel(base, Lora(4, 7), torch.device("cpu"))  # type: ignore[arg-type]
    ce = TrainedModel(base, Lora(4, 7), torch.device("cpu"))  # type: ignore[arg-type]
    # sampler log-probs around the model's own (-5.6) so that ratios fall both in and
    # out of PPO's clip range; advantages of both signs
    data = [_rl_datum([40, 41, 42, 43, 44], [-5.4, -5.9, -5.0, -6.3, -5.6],
                      [1.0, -0.5, 2.0, 1.5, -1.0]),
            _rl_datum([60, 61, 62], [-5.2, -6.0, -5.7], [-2.0, 0.5, 1.0])]
    outputs, _ = rl.forward_backward(data, name, {}, forward_only=False)
    ratios = np.concatenate([np.exp(o["logprobs"] - d.inputs["logprobs"])
                             for o, d in zip(outputs, data, strict=True)])
    if name == "ppo":  # the test covers both branches of the min
        assert (ratios > 1.2).any() and (ratios < 1.2).any()
    weighted = [_datum(d.tokens, list(-_dloss_dlp(name, o["logprobs"], d.inputs["logprobs"],
                                                   d.inputs["advantages"])))
                for o, d in zip(outputs, data, strict=True)]
    ce.forward_backward(weighted, "cross_entropy", {}, forward_only=False)
    grads = [(a.grad, b.grad) for a, b in zip(rl.params, ce.params, strict=True)]
    assert any(float(g.abs().sum()) > 0 for g, _ in grads if g is not None)
    for a, b in grads:
        assert a is not None and b is not None
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
