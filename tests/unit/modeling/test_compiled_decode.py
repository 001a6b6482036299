"""The compiled decode step samples what the eager one samples: the same tokens under the
keyed sampler, the same behaviour log-probs to float rounding, rows leaving the batch and
the cache growing without a recompile; a compiler failure falls back to the eager step.

The graph is traced whole (fullgraph) through torch.compile with the `eager` backend (Dynamo's capture, no codegen):
the capture, the functional layer and its two-block attention are what is tested here, in
seconds; inductor's generated kernels run in bench/bench_decode.py --compiled (minutes of
gcc on a loaded box), which reports whether the tokens are equal too."""

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from rlhf_async.modeling import compiled_decode as cd
from rlhf_async.modeling.decode_step import PACK_MIN_STEPS, decode_step
from rlhf_async.modeling.generation import SamplingParams, sample, sampling_uniforms

EOS, PAD, V = 3, 0, 24


@pytest.fixture
def traced(monkeypatch):
    monkeypatch.setattr(cd, "BACKEND", "eager")
    monkeypatch.setattr(cd, "_GRAPHS", {})
    monkeypatch.setattr(cd, "_FAILED", set())
    monkeypatch.setattr(cd, "_ENABLED", [False])
    monkeypatch.setattr(cd, "_SETTING", ["auto"])
    monkeypatch.setattr(cd, "_TOO_BIG", set())


def _gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=40, n_embd=32, n_layer=2,
                                      n_head=4, eos_token_id=EOS, pad_token_id=PAD)).eval()


def _sample(model, compiled: bool, new_tokens: int = 12, prompt: int = 6):
    ids = torch.tensor([[0, 0, 1, 5, 6, 2], [1, 7, 8, 9, 4, 2], [0, 1, 4, 4, 5, 2]]).repeat(4, 1)
    ids = ids[:, -prompt:]
    mask = (ids != PAD).long()  # left padding
    sp = SamplingParams(max_new_tokens=new_tokens, eos_id=EOS, pad_id=PAD)  # rows end early
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
    assert [k[0] for k in cd._GRAPHS] == ["gpt2"] and not cd._FAILED


def test_rows_leaving_and_new_lengths_compile_once(traced, monkeypatch):
    """One graph for a call whose rows end at different steps and for later calls with
    other prompt and response lengths (other cache capacities): rows and cached positions
    are dynamic, the config's numbers constants."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    monkeypatch.setattr(cd, "BACKEND", counting)
    model = _gpt2()
    for new_tokens, prompt in ((12, 6), (7, 4), (15, 5)):
        out = _sample(model, True, new_tokens, prompt)
        assert torch.equal(out.response_ids, _sample(model, False, new_tokens, prompt).response_ids)
    assert len(graphs) == 1
    # heads and head dim are constants of the graph (4 x 8), the rows a symbol
    views = [line for line in graphs[0].code.splitlines() if "addmm.view(" in line]
    assert views and all(line.rstrip(";").split("view(")[1].split(")")[0].endswith(
        ", 3, 4, 1, 8") for line in views)


def test_a_compiler_failure_falls_back_to_the_eager_step(traced, monkeypatch):
    model = _gpt2()
    eager = _sample(model, False)

    def broken(*a, **k):
        raise RuntimeError("no compiler")
    monkeypatch.setattr(cd, "_gpt2_forward", lambda *config: broken)
    out = _sample(model, True)
    assert torch.equal(out.response_ids, eager.response_ids)
    torch.testing.assert_close(out.logprobs, eager.logprobs)
    assert "gpt2" in cd._FAILED and len(cd._FAILED) == 1


def test_the_compiled_step_packs_no_eager_weights(traced, monkeypatch):
    """The eager step packs its weights for oneDNN at every call from PACK_MIN_STEPS steps
    (CPU): the compiled step makes it only at a compiler failure."""
    made = []

    def spy(model, steps=0):
        made.append(steps)
        return decode_step(model, steps)
    monkeypatch.setattr(cd, "decode_step", spy)
    model = _gpt2()
    step = cd.compiled_decode_step(model, 100)
    assert step is not None and all(s < PACK_MIN_STEPS for s in made)


def test_auto_leaves_big_models_eager_and_on_compiles_them(traced, monkeypatch):
    model = _gpt2()
    monkeypatch.setattr(cd, "COMPILE_MAX_PARAMS", sum(p.numel() for p in model.parameters()) - 1)
    cd.choose(torch.device("cpu"), cd.COMPILE_MIN_STEPS, "auto")
    assert cd.compiling()
    eager = _sample(model, True)  # (compiling() stays on: the size decides per model)
    assert cd._GRAPHS == {} and len(cd._TOO_BIG) == 1
    cd.choose(torch.device("cpu"), 1, "on")
    compiled = _sample(model, True)
    assert [k[0] for k in cd._GRAPHS] == ["gpt2"]
    assert torch.equal(eager.response_ids, compiled.response_ids)


def test_compile_only_where_it_pays():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert cd.compile_pays(cpu, cd.COMPILE_MIN_STEPS)[0]
    assert not cd.compile_pays(cpu, cd.COMPILE_MIN_STEPS - 1)[0]
    assert not cd.compile_pays(cuda, 10**9)[0]
    assert cd.compile_pays(cpu, 1, "on") == (True, "generation.compile = on")
    assert not cd.compile_pays(cpu, 10**9, "off")[0]


def _llama(**config) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=40, eos_token_id=EOS,
        pad_token_id=PAD, bos_token_id=1, **config)).eval()


@pytest.mark.parametrize("config", [
    {"num_key_value_heads": 2},  # grouped-query heads, as SmolLM2's
    {"num_key_value_heads": 4, "attention_bias": True, "mlp_bias": True,
     "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
])
def test_llama_shaped_compiled_samples_what_eager_samples(traced, config):
    model = _llama(**config)
    eager, compiled = _sample(model, False), _sample(model, True)
    assert torch.equal(eager.response_ids, compiled.response_ids)
    assert 0 < int(compiled.response_mask.sum()) < compiled.response_mask.numel()
    torch.testing.assert_close(eager.logprobs, compiled.logprobs, rtol=1e-5, atol=1e-5)
    assert [k[0] for k in cd._GRAPHS] == ["llama"] and not cd._FAILED


def test_other_architectures_keep_the_eager_step(traced):
    gemma = Gemma2ForCausalLM(Gemma2Config(vocab_size=V, hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=1, num_attention_heads=4,
                                           num_key_value_heads=4, head_dim=8))
    step = cd.compiled_decode_step(gemma, 0)
    assert step is None and cd._GRAPHS == {}
