import torch
from transformers import GPT2Config, GPT2LMHeadModel

from rlhf_async.algorithms import gather_logprobs
from rlhf_async.generation import SamplingParams, generate, sampling_uniforms
from rlhf_async.models import response_logits

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
    full = generate(lm, ids, mask, sp, sampling_uniforms(7, 3, sids, 6, 16))
    order = [2, 0, 3]  # a different, smaller batch in another order
    part = generate(lm, ids[order], mask[order], sp,
                    sampling_uniforms(7, 3, [sids[i] for i in order], 6, 16))
    assert torch.equal(part.response_ids, full.response_ids[order])
    assert torch.allclose(part.logprobs, full.logprobs[order], atol=1e-5)
    other_step = generate(lm, ids, mask, sp, sampling_uniforms(7, 4, sids, 6, 16))
    assert not torch.equal(other_step.response_ids, full.response_ids)


def test_masks_eos_padding_and_behaviour_logprobs():
    lm, (ids, mask) = tiny_lm(1), prompts()
    sp = SamplingParams(max_new_tokens=8, eos_id=EOS, pad_id=PAD, temperature=0.7)
    # force EOS early for row 0 by making its uniforms pick EOS at step 2
    u = sampling_uniforms(0, 0, [0, 1, 2, 3], 8, 16)
    u[0, 2, :] = 1e-12
    u[0, 2, EOS] = 1 - 1e-12
    g = generate(lm, ids, mask, sp, u)
    assert g.response_ids.shape == (4, 8)
    assert g.response_ids[0, 2] == EOS and g.response_mask[0].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    for b in range(4):
        m = g.response_mask[b].bool()
        toks = g.response_ids[b]
        if (toks[m] == EOS).any():  # nothing after EOS
            assert int((toks[m] == EOS).nonzero()[0]) == int(m.sum()) - 1
        assert (toks[~m] == PAD).all() and (g.logprobs[b][~m] == 0).all()
    # behaviour log-probs equal a teacher-forced forward pass (same temperature)
    logits = response_logits(lm, ids, mask, g.response_ids, g.response_mask)
    lp = gather_logprobs(logits, g.response_ids, 0.7) * g.response_mask
    assert torch.allclose(lp, g.logprobs, atol=1e-4)


def test_top_k_restricts_choices():
    lm, (ids, mask) = tiny_lm(2), prompts()
    sp = SamplingParams(max_new_tokens=4, eos_id=EOS, pad_id=PAD, top_k=1)
    g = generate(lm, ids, mask, sp, sampling_uniforms(0, 0, [0, 1, 2, 3], 4, 16))
    greedy = response_logits(lm, ids, mask, g.response_ids, g.response_mask).argmax(-1)
    m = g.response_mask.bool()
    assert torch.equal(g.response_ids[m], greedy[m])
    assert torch.allclose(g.logprobs[m], torch.zeros_like(g.logprobs[m]))
