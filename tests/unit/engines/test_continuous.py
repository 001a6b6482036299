"""Continuous batching gives each row the tokens `sample` gives it alone, whatever shares
its batch, when it entered, and however often the cache was compacted."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from rlhf_async.engines.torch.continuous import ContinuousBatch
from rlhf_async.modeling.generation import SamplingParams, sample, sampling_uniforms
from rlhf_async.modeling.rollout import PromptBatch

EOS, PAD, V = 3, 0, 16


def gpt2(seed=0):
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=64, n_embd=32, n_layer=2,
                                      n_head=2, eos_token_id=EOS, pad_token_id=PAD)).eval()


def llama(seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=64,
                                        eos_token_id=EOS, pad_token_id=PAD)).eval()


def chunk(seed, rows, width):
    """Left-padded prompts of 1..width tokens (never EOS), sample ids from seed * 100."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, V, (rows, width), generator=g)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    mask = (torch.arange(width)[None, :] >= width - lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, PAD)
    sids = torch.arange(rows) + 100 * seed
    return PromptBatch(ids, mask, sids, sids // 2)


def alone(lm, p, sp, step):
    u = sampling_uniforms(0, step, p.sample_ids.tolist(), sp.max_new_tokens)
    return sample(lm, p.prompt_ids, p.prompt_mask, sp, u)


def run(batch, chunks, sp, step_of=lambda k: k, version=lambda n: 0):
    """Add the chunks (one more every 3 steps) and step until all are handed back."""
    got, n, todo = {}, 0, list(chunks)
    while todo or batch.busy:
        if todo and n % 3 == 0:
            k, p = todo.pop(0)
            batch.add(k, p, sampling_uniforms(0, step_of(k), p.sample_ids.tolist(),
                                              sp.max_new_tokens))
        for k, g in batch.step(version(n)):
            got[k] = g
        n += 1
    return got


@pytest.mark.parametrize("make", [gpt2, llama])
@pytest.mark.parametrize("slots", [1, 3, 8, 64])
def test_each_row_samples_what_it_samples_alone(make, slots):
    lm = make()
    sp = SamplingParams(max_new_tokens=12, eos_id=EOS, pad_id=PAD, temperature=1.3)
    chunks = [(k, chunk(k, rows, width)) for k, (rows, width) in
              enumerate([(6, 5), (4, 9), (8, 3), (5, 7)])]
    got = run(ContinuousBatch(lm, sp, slots), chunks, sp)
    assert sorted(got) == [0, 1, 2, 3]
    for k, p in chunks:
        want = alone(lm, p, sp, k)
        assert torch.equal(got[k].response_ids, want.response_ids), (k, slots)
        assert torch.equal(got[k].response_mask, want.response_mask)
        torch.testing.assert_close(got[k].logprobs, want.logprobs, atol=1e-5, rtol=0)
        assert torch.equal(got[k].token_versions, torch.where(want.response_mask.bool(), 0, -1))
    lengths = torch.cat([got[k].response_mask.sum(1) for k in got])
    assert (lengths < 12).any() and (lengths == 12).any()  # EOS and the length limit both seen


def test_compaction_and_wider_prompts_keep_the_tokens():
    """Long responses and a stream of chunks fill the cache's columns many times over; a
    later chunk's prompts are wider than the columns in use."""
    lm = gpt2(1)
    sp = SamplingParams(max_new_tokens=20, eos_id=EOS, pad_id=PAD, min_new_tokens=4)
    chunks = [(k, chunk(k + 10, 4, 2 if k < 4 else 12)) for k in range(7)]
    batch = ContinuousBatch(lm, sp, 5)
    compactions = []
    real = batch._compact

    def counted(min_length=0):
        compactions.append(min_length)
        real(min_length)
    batch._compact = counted
    got = run(batch, chunks, sp)
    assert len(compactions) >= 2
    for k, p in chunks:
        want = alone(lm, p, sp, k)
        assert torch.equal(got[k].response_ids, want.response_ids), k
        assert (got[k].response_mask.sum(1) >= 5).all()  # min_new_tokens bars an early EOS
    assert batch.cache is None and batch.rows == 0  # drained: the cache is let go


def test_each_token_records_the_version_it_was_sampled_with():
    lm = gpt2(2)
    sp = SamplingParams(max_new_tokens=10, eos_id=EOS, pad_id=PAD)
    chunks = [(k, chunk(k + 20, 4, 4)) for k in range(3)]
    got = run(ContinuousBatch(lm, sp, 4), chunks, sp, version=lambda n: n // 4)
    for k in got:
        v, m = got[k].token_versions, got[k].response_mask.bool()
        assert (v[~m] == -1).all() and (v[m] >= 0).all()
        for row in v:  # versions never go down along a response
            real = row[row >= 0]
            assert (real[1:] >= real[:-1]).all()
    assert len({int(x) for k in got for x in got[k].token_versions.flatten()}) > 3


def test_stop_strings_end_a_row_at_the_completing_token():
    lm = gpt2(3)
    decode = lambda ids: "".join(chr(ord("a") + i) for i in ids)  # noqa: E731
    sp = SamplingParams(max_new_tokens=12, eos_id=EOS, pad_id=PAD, stop_strings=("h", "jk"),
                        decode=decode)
    chunks = [(k, chunk(k + 30, 6, 4)) for k in range(3)]
    got = run(ContinuousBatch(lm, sp, 4), chunks, sp)
    for k, p in chunks:
        assert torch.equal(got[k].response_ids, alone(lm, p, sp, k).response_ids)


def test_unsupported_models_and_episodes_are_refused():
    from transformers import OPTConfig, OPTForCausalLM
    opt = OPTForCausalLM(OPTConfig(vocab_size=V, hidden_size=16, num_hidden_layers=1,
                                   ffn_dim=32, num_attention_heads=2, word_embed_proj_dim=16))
    sp = SamplingParams(max_new_tokens=4, eos_id=EOS, pad_id=PAD)
    with pytest.raises(ValueError, match="continuous_batching = false"):
        ContinuousBatch(opt, sp, 4)
    with pytest.raises(ValueError, match="at least 1 slot"):
        ContinuousBatch(gpt2(), sp, 0)
