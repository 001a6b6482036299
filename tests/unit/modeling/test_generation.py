import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from rlhf_async.modeling.generation import (
    SamplingParams,
    completes_stop_string,
    sample,
    sampling_uniforms,
)
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
    from rlhf_async.modeling.generation import scaled_logprobs

    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    keep = scaled_logprobs(logits, SamplingParams(4, EOS, PAD, top_p=0.7)).exp()
    torch.testing.assert_close(keep, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    one = scaled_logprobs(logits, SamplingParams(4, EOS, PAD, top_p=0.4)).exp()
    torch.testing.assert_close(one, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))  # the first stays
    full = scaled_logprobs(logits, SamplingParams(4, EOS, PAD)).exp()
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


PIECES = [chr(ord("a") + i) * (1 + i % 3) for i in range(16)]  # token i: 1 to 3 characters


def decode(ids):
    return "".join(PIECES[i] for i in ids)


def test_a_stop_string_is_completed_by_the_newest_token_only():
    assert completes_stop_string([1, 2, 4], ("ce",), decode)  # "b" "cc" "eee": across tokens
    assert not completes_stop_string([2, 4, 1], ("ce",), decode)  # completed one token ago
    assert completes_stop_string([1, 1, 1], ("bb",), decode)  # a second, overlapping one
    utf8 = lambda ids: bytes(ids).decode("utf-8", errors="replace")  # noqa: E731
    assert completes_stop_string([ord("x"), 0xC3, 0xA9], ("é",), utf8)  # its second byte
    assert not completes_stop_string([ord("x"), 0xC3], ("é",), utf8)
    assert not completes_stop_string([0xC3, 0xA9, ord("x")], ("é",), utf8)


def _ends(tokens, strings):
    """Reference: a response's length once cut after the first token whose text (the whole
    prefix, decoded) holds a stop string."""
    return next((t + 1 for t in range(len(tokens))
                 if any(s in decode(tokens[: t + 1]) for s in strings)), len(tokens))


def test_stop_strings_cut_each_row_where_its_own_text_completes_one():
    lm, (ids, mask) = tiny_lm(3), prompts()
    ids, mask = ids.repeat(2, 1), mask.repeat(2, 1)  # 8 rows, each with its own noise
    sids = list(range(8))
    u = sampling_uniforms(0, 0, sids, 8)
    free = sample(lm, ids, mask, SamplingParams(8, EOS, PAD), u)
    r0, r3 = free.response_ids[0].tolist(), free.response_ids[3].tolist()
    # strings across the boundary of row 0's tokens 1 and 2, and of row 3's tokens 2 and 3
    strings = (PIECES[r0[1]][-1] + PIECES[r0[2]][0], PIECES[r3[2]][-1] + PIECES[r3[3]][0])
    sp = SamplingParams(8, EOS, PAD, stop_strings=strings, decode=decode)
    g = sample(lm, ids, mask, sp, u)
    lengths = [int(n) for n in g.response_mask.sum(1)]
    for b in range(8):  # the free run, cut: every row's tokens are its own noise's
        n = _ends(free.response_ids[b, : int(free.response_mask[b].sum())].tolist(), strings)
        assert lengths[b] == n and torch.equal(g.response_ids[b, :n], free.response_ids[b, :n])
        assert torch.allclose(g.logprobs[b, :n], free.logprobs[b, :n], atol=1e-6)
        assert (g.response_ids[b, n:] == PAD).all() and (g.logprobs[b, n:] == 0).all()
    assert lengths[0] <= 3 and lengths[3] <= 4  # cut by the strings made from their tokens
    assert lengths[6] == int(free.response_mask[6].sum()) == 8  # a row without one: as free
    order = [3, 6, 0]  # another batch, another order: the same rows
    part = sample(lm, ids[order], mask[order], sp,
                  sampling_uniforms(0, 0, [sids[i] for i in order], 8))
    assert torch.equal(part.response_ids, g.response_ids[order])
    assert torch.equal(part.response_mask, g.response_mask[order])
    late = sample(lm, ids, mask, SamplingParams(8, EOS, PAD, min_new_tokens=4,
                                                stop_strings=strings, decode=decode), u)
    assert late.response_mask[:, :5].all()  # no string ends a response before token 4
    with pytest.raises(ValueError, match="needs SamplingParams.decode"):
        sample(lm, ids, mask, SamplingParams(8, EOS, PAD, stop_strings=strings), u)
