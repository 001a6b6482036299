import torch
from transformers import GPT2Config, GPT2LMHeadModel

from rlhf_async.modeling.generation import SamplingParams, sample, sampling_uniforms
from rlhf_async.modeling.models import response_logits
from rlhf_async.rl.algorithms import gather_logprobs

EOS, PAD = 3, 0


def tiny_lm(seed=0, vocab=16):
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                     bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD)
    return GPT2LMHeadModel(cfg).eval()


def prompts():
    # left-padded prompts of different lengths
    ids = torch.tensor([[0, 0, 1, 5, 6, 2], [1, 7, 8, 9, 4, 2], [0, 1, 4, 4, 5, 2],
                        [0, 0, 0, 1, 9, 2]])
    return ids, (ids != PAD).long()


def test_tokens_depend_only_on_sample_id_not_batch_composition():
    lm, (ids, mask) = tiny_lm(), prompts()
    sp = SamplingParams(max_new_tokens=6, eos_id=EOS, pad_id=PAD)
    sids = [10, 11, 12, 13]
    full = sample(lm, ids, mask, sp, sampling_uniforms(7, 3, sids, 6))
    order = [2, 0, 3]  # a different, smaller batch in another order
    part = sample(lm, ids[order], mask[order], sp,
                    sampling_uniforms(7, 3, [sids[i] for i in order], 6))
    assert torch.equal(part.response_ids, full.response_ids[order])
    assert torch.allclose(part.logprobs, full.logprobs[order], atol=1e-5)
    other_step = sample(lm, ids, mask, sp, sampling_uniforms(7, 4, sids, 6))
    assert not torch.equal(other_step.response_ids, full.response_ids)


def test_masks_eos_padding_and_behaviour_logprobs():
    lm, (ids, mask) = tiny_lm(1), prompts()
    ids, mask = ids.repeat(4, 1), mask.repeat(4, 1)  # 16 rows, each with its own noise
    sp = SamplingParams(max_new_tokens=8, eos_id=EOS, pad_id=PAD, temperature=0.7)
    g = sample(lm, ids, mask, sp, sampling_uniforms(0, 0, list(range(16)), 8))
    assert g.response_ids.shape == (16, 8)
    lengths = g.response_mask.sum(1)
    assert (lengths < 8).any() and (lengths == 8).any()  # both early EOS and truncation
    for b in range(16):
        m = g.response_mask[b].bool()
        toks = g.response_ids[b]
        assert m[: int(lengths[b])].all()  # the mask is a prefix
        if (toks[m] == EOS).any():  # EOS is the last real token, nothing after it
            assert int((toks[m] == EOS).nonzero()[0]) == int(lengths[b]) - 1
        else:
            assert lengths[b] == 8
        assert (toks[~m] == PAD).all() and (g.logprobs[b][~m] == 0).all()
    # behaviour log-probs equal a teacher-forced forward pass (same temperature)
    logits = response_logits(lm, ids, mask, g.response_ids, g.response_mask)
    lp = gather_logprobs(logits, g.response_ids, 0.7) * g.response_mask
    assert torch.allclose(lp, g.logprobs, atol=1e-4)


def test_sampling_follows_the_distribution():
    lm, (ids, mask) = tiny_lm(3), prompts()
    ids, mask = ids[:1].repeat(4000, 1), mask[:1].repeat(4000, 1)
    sp = SamplingParams(max_new_tokens=1, eos_id=EOS, pad_id=PAD)
    g = sample(lm, ids, mask, sp, sampling_uniforms(0, 0, list(range(4000)), 1))
    probs = torch.softmax(lm(input_ids=ids[:1], attention_mask=mask[:1],
                             position_ids=(mask[:1].cumsum(1) - 1).clamp(min=0)).logits[0, -1],
                          -1)
    freq = torch.bincount(g.response_ids[:, 0], minlength=16).float() / 4000
    assert (freq - probs).abs().max() < 0.03


def test_top_k_restricts_choices():
    lm, (ids, mask) = tiny_lm(2), prompts()
    sp = SamplingParams(max_new_tokens=4, eos_id=EOS, pad_id=PAD, top_k=1)
    g = sample(lm, ids, mask, sp, sampling_uniforms(0, 0, [0, 1, 2, 3], 4))
    greedy = response_logits(lm, ids, mask, g.response_ids, g.response_mask).argmax(-1)
    m = g.response_mask.bool()
    assert torch.equal(g.response_ids[m], greedy[m])
    assert torch.allclose(g.logprobs[m], torch.zeros_like(g.logprobs[m]))


def test_top_p_keeps_the_smallest_set_that_reaches_it():
    from rlhf_async.modeling.generation import _scaled_logprobs

    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    keep = _scaled_logprobs(logits, SamplingParams(4, EOS, PAD, top_p=0.7)).exp()
    torch.testing.assert_close(keep, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    one = _scaled_logprobs(logits, SamplingParams(4, EOS, PAD, top_p=0.4)).exp()
    torch.testing.assert_close(one, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))  # the first stays
    full = _scaled_logprobs(logits, SamplingParams(4, EOS, PAD)).exp()
    torch.testing.assert_close(full, logits.exp())


def test_stop_tokens_end_responses_and_none_comes_before_min_new_tokens():
    lm, (ids, mask) = tiny_lm(3), prompts()
    u = sampling_uniforms(0, 0, [0, 1, 2, 3], 6)
    free = sample(lm, ids, mask, SamplingParams(6, EOS, PAD), u)
    stop = int(free.response_ids[0, 1])  # a token row 0 samples second: now a stop token
    g = sample(lm, ids, mask, SamplingParams(6, EOS, PAD, stop_ids=(stop,)), u)
    assert g.response_ids[0, 1] == stop and g.response_mask[0].tolist() == [1, 1, 0, 0, 0, 0]
    late = sample(lm, ids, mask, SamplingParams(6, EOS, PAD, stop_ids=(stop,),
                                                min_new_tokens=4), u)
    first = late.response_ids[:, :4]
    assert not torch.isin(first, torch.tensor([EOS, stop])).any()
    assert late.response_mask[:, :4].all()
