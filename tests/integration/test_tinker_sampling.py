"""Sampling through the Tinker-compatible API with the real `tinker` client (0.38.0):
save_weights_for_sampler (ephemeral and named), create_sampling_session, asample with its
settings, compute_logprobs; and an RL loop (sample -> rule reward -> importance_sampling)
that raises the reward."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from rlhf_async.ops.tinker.base_models import BUILTIN  # noqa: E402
from tests.tinker_api import KEY, running_api  # noqa: E402


@pytest.fixture(autouse=True)
def _no_telemetry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINKER_TELEMETRY", "0")


@pytest.fixture
def service(tmp_path: Path, one_thread: None) -> object:
    with running_api(tmp_path) as url:
        client = tinker.ServiceClient(base_url=url, api_key=KEY)
        yield client
        client.close("success").result()


def _params(**kw: object) -> types.SamplingParams:
    return types.SamplingParams(**{"max_tokens": 6, "seed": 1, **kw})  # type: ignore[arg-type]


def _rl_data(prompt: list[int], seqs: list[types.SampledSequence],
             advantages: list[float]) -> list[types.Datum]:
    """One datum per sample: the prompt's positions weigh nothing (advantage 0)."""
    out = []
    for s, a in zip(seqs, advantages, strict=True):
        full = prompt + s.tokens
        pad = len(prompt) - 1
        out.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                               loss_fn_inputs={"target_tokens": full[1:],
                                               "logprobs": [0.0] * pad + list(s.logprobs),
                                               "advantages": [0.0] * pad + [a] * len(s.tokens)}))
    return out


def test_an_rl_loop_raises_a_rule_reward(service: object) -> None:
    training = service.create_lora_training_client(base_model=BUILTIN, rank=8, seed=0).result()
    prompt = training.get_tokenizer().encode("count:")
    rewards = []
    for step in range(10):
        sampler = training.save_weights_and_get_sampling_client().result()
        seqs = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=16,
                              sampling_params=_params(max_tokens=8, seed=step, stop=[]),
                              ).result().sequences
        # the rule: the share of even token ids (about half, for a model that knows nothing)
        r = [float(np.mean([t % 2 == 0 for t in s.tokens])) for s in seqs]
        rewards.append(float(np.mean(r)))
        fb = training.forward_backward(_rl_data(prompt, seqs, [x - rewards[-1] for x in r]),
                                       "importance_sampling")
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        fb.result()
    assert np.mean(rewards[-2:]) > np.mean(rewards[:2]) + 0.2, rewards


def test_sampled_logprobs_are_the_policys_and_seeds_repeat(service: object) -> None:
    training = service.create_lora_training_client(base_model=BUILTIN, rank=4, seed=0).result()
    prompt = types.ModelInput.from_ints(training.get_tokenizer().encode("abc"))
    # one step first, so that every adapter (the tied unembedding's too) is non-zero
    training.forward_backward([types.Datum(model_input=prompt, loss_fn_inputs={
        "target_tokens": [7, 8, 9]})], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    first = sampler.sample(prompt, 3, _params(stop=[])).result().sequences
    again = sampler.sample(prompt, 3, _params(stop=[])).result().sequences
    other = sampler.sample(prompt, 3, _params(seed=2, stop=[])).result().sequences
    assert [s.tokens for s in first] == [s.tokens for s in again]
    assert [s.tokens for s in first] != [s.tokens for s in other]
    assert all(len(s.tokens) == 6 and s.stop_reason == "length" for s in first)
    # at temperature 1 without top-k/top-p the behaviour log-probs are the model's own
    data = [types.Datum(model_input=types.ModelInput.from_ints(prompt.to_ints() + s.tokens[:-1]),
                        loss_fn_inputs={"target_tokens": prompt.to_ints()[1:] + s.tokens})
            for s in first]
    out = training.forward(data, "cross_entropy").result().loss_fn_outputs
    for s, o in zip(first, out, strict=True):
        assert o["logprobs"].to_numpy()[-len(s.tokens):] == pytest.approx(s.logprobs, abs=1e-4)
    # and compute_logprobs scores a prompt the same way (its first token has no context)
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(data[0].model_input.to_ints()
                                                                 )).result()
    assert scored[0] is None
    assert scored[1:] == pytest.approx(out[0]["logprobs"].to_numpy()[:-1].tolist(), abs=1e-4)


def test_greedy_stops_and_named_sampler_weights(service: object) -> None:
    training = service.create_lora_training_client(base_model=BUILTIN, rank=4, seed=0).result()
    tok = training.get_tokenizer()
    prompt = types.ModelInput.from_ints(tok.encode("hello"))
    training.forward_backward([types.Datum(  # move the weights off the base model's
        model_input=prompt, loss_fn_inputs={"target_tokens": tok.encode("world")[:5]})],
        "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    snapshot = training.save_weights_and_get_sampling_client().result()
    greedy = snapshot.sample(prompt, 2, _params(temperature=0.0, stop=[])).result().sequences
    assert greedy[0].tokens == greedy[1].tokens  # temperature 0: the argmax, every sample
    g = greedy[0].tokens
    cut = snapshot.sample(prompt, 1, _params(temperature=0.0, stop=[g[2]])).result()
    want = g[:g.index(g[2]) + 1]
    assert cut.sequences[0].tokens == want and cut.sequences[0].stop_reason == "stop"
    # weights saved under a name load into a sampler of their own, the same policy
    path = training.save_weights_for_sampler("step-1").result().path
    assert path.startswith("tinker://") and path.endswith("/sampler_weights/step-1")
    named = service.create_sampling_client(model_path=path).result()
    assert named.get_base_model() == BUILTIN
    assert named.sample(prompt, 2, _params(temperature=0.0, stop=[])).result().sequences[0] \
        .tokens == g
    base = service.create_sampling_client(base_model=BUILTIN).result()
    assert base.sample(prompt, 1, _params(temperature=0.0, stop=[])).result().sequences[0] \
        .tokens != g


@pytest.mark.parametrize(("kw", "message"), [
    ({"max_tokens": 5000}, "max_tokens 5000"),
    ({"top_k": 0}, "top_k must be -1"),
    ({"temperature": -1.0}, "temperature must be >= 0"),
], ids=["too-long", "top-k", "temperature"])
def test_a_bad_sample_request_is_a_user_error(service: object, kw: dict[str, object],
                                              message: str) -> None:
    sampler = service.create_sampling_client(base_model=BUILTIN).result()
    with pytest.raises(tinker.RequestFailedError, match=message) as e:
        sampler.sample(types.ModelInput.from_ints([5, 6]), 1, _params(**kw)).result()
    assert e.value.category == types.RequestErrorCategory.User


def test_an_unknown_sampler_model_is_refused(service: object) -> None:
    with pytest.raises(tinker.BadRequestError, match="unknown base_model 'no/such'"):
        service.create_sampling_client(base_model="no/such").result()
    with pytest.raises(tinker.BadRequestError, match="no checkpoint"):
        service.create_sampling_client(
            model_path="tinker://run_1/sampler_weights/none").result()
