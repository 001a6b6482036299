"""The compiled decode step samples what the eager one samples: the same tokens under the
keyed sampler, the same behaviour log-probs to float rounding, rows leaving the batch and
the cache growing without a recompile; a compiler failure falls back to the eager step.

The graph is traced whole (fullgraph) through torch.compile with the `eager` backend (Dynamo's capture, no codegen):
the capture, the functional layer and its two-block attention are what is tested here, in
seconds; inductor's generated kernels run in bench/bench_decode.py --compiled (minutes of
gcc on a loaded box), which reports whether the tokens are equal too."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from rlhf_async.modeling import compiled_decode as cd
from rlhf_async.modeling.generation import SamplingParams, sample, sampling_uniforms

EOS, PAD, V = 3, 0, 24


@pytest.fixture
def traced(monkeypatch):
    monkeypatch.setattr(cd, "BACKEND", "eager")
    monkeypatch.setattr(cd, "_GRAPHS", {})
    monkeypatch.setattr(cd, "_FAILED", set())
    monkeypatch.setattr(cd, "_ENABLED", [False])


def _gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=40, n_embd=32, n_layer=2,
                                      n_head=4, eos_token_id=EOS, pad_token_id=PAD)).eval()


def _sample(model, compiled: bool):
    ids = torch.tensor([[0, 0, 1, 5, 6, 2], [1, 7, 8, 9, 4, 2], [0, 1, 4, 4, 5, 2]]).repeat(4, 1)
    mask = (ids != PAD).long()  # left padding
    sp = SamplingParams(max_new_tokens=12, eos_id=EOS, pad_id=PAD)  # rows end early
    u = sampling_uniforms(0, 0, list(range(len(ids))), sp.max_new_tokens)
    cd._ENABLED[0] = compiled
    return sample(model, ids, mask, sp, u)


def test_compiled_samples_what_eager_samples(traced):
    model = _gpt2()
    eager, compiled = _sample(model, False), _sample(model, True)
    assert torch.equal(eager.response_ids, compiled.response_ids)
    assert torch.equal(eager.response_mask, compiled.response_mask)
    assert 0 < int(compiled.response_mask.sum()) < compiled.response_mask.numel()  # rows ended
    torch.testing.assert_close(eager.logprobs, compiled.logprobs, rtol=1e-5, atol=1e-5)
    assert "gpt2" in cd._GRAPHS and not cd._FAILED


def test_a_compiler_failure_falls_back_to_the_eager_step(traced, monkeypatch):
    model = _gpt2()
    eager = _sample(model, False)

    def broken(*a, **k):
        raise RuntimeError("no compiler")
    monkeypatch.setattr(cd, "_GRAPHS", {"gpt2": broken})
    out = _sample(model, True)
    assert torch.equal(out.response_ids, eager.response_ids)
    torch.testing.assert_close(out.logprobs, eager.logprobs)
    assert "gpt2" in cd._FAILED and len(cd._FAILED) == 1


def test_compile_only_where_it_pays():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert cd.compile_pays(cpu, cd.COMPILE_MIN_STEPS)[0]
    assert not cd.compile_pays(cpu, cd.COMPILE_MIN_STEPS - 1)[0]
    assert not cd.compile_pays(cuda, 10**9)[0]
    assert cd.compile_pays(cpu, 1, "on") == (True, "generation.compile = on")
    assert not cd.compile_pays(cpu, 10**9, "off")[0]


def test_other_architectures_keep_the_eager_step(traced):
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=4))
    step = cd.compiled_decode_step(llama, 0)
    assert step is not None and cd._GRAPHS == {}
