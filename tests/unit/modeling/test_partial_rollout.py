"""Partial rollouts: weights swapped between two decode steps of one `sample` call."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from rlhf_async.modeling.generation import SamplingParams, generate, sample, sampling_uniforms
from rlhf_async.modeling.models import cache_keyword, output_cache
from rlhf_async.modeling.rollout import PromptBatch, RolloutBatch, RolloutFormatError
from rlhf_async.rl.algorithms import importance_weights
from rlhf_async.rl.token_versions import token_version_metrics

EOS, PAD, R = 3, 0, 10


def tiny_lm(seed):
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=16, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                     bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD)
    return GPT2LMHeadModel(cfg).eval()


def prompts():
    ids = torch.tensor([[1, 5, 6, 2], [1, 7, 8, 9], [1, 4, 4, 5], [1, 9, 2, 2]])
    return ids, torch.ones_like(ids)


class SwapAt:
    """A `between` hook that copies `new` weights into `actor` at its `at`-th call."""

    def __init__(self, actor, new, at, version=1, start=0):
        self.actor, self.new, self.at, self.version = actor, new, at, version
        self.calls, self.held = 0, start

    def __call__(self):
        self.calls += 1
        if self.calls == self.at:
            self.actor.load_state_dict(self.new)
            self.held = self.version
        return self.held


def params():
    return SamplingParams(max_new_tokens=R, eos_id=EOS, pad_id=PAD, temperature=0.9)


def mixed_cache_logprobs(a, b, ids, tokens, j, temperature):
    """[len(tokens) - j, V] log-probs of tokens[j + 1:] when the cache of the prompt and
    tokens[:j] came from `a` and token j onwards is fed through `b` (what a swap before
    decode step j does)."""
    with torch.no_grad():
        out = a(input_ids=torch.cat([ids, tokens[:j]])[None], use_cache=True)
        rest = b(input_ids=tokens[j:][None], use_cache=True,
                 **{cache_keyword(b): output_cache(out)})
    return torch.log_softmax(rest.logits[0].float() / temperature, -1)


def test_a_swap_mid_sample_records_each_tokens_version_and_logprob():
    old, new = tiny_lm(0), tiny_lm(1)
    actor = tiny_lm(0)
    ids, mask = prompts()
    sp = params()
    u = sampling_uniforms(5, 0, [0, 1, 2, 3], R)
    k = 4  # the 4th call, before decode step 3 (which feeds token 3): tokens 0..3 by v0
    hook = SwapAt(actor, new.state_dict(), at=k)
    g = sample(actor, ids, mask, sp, u, version=0, between=hook)
    real = g.response_mask.bool()
    assert torch.equal(g.token_versions[~real], torch.full_like(g.token_versions[~real], -1))
    lengths = real.sum(1)
    assert (lengths > k + 1).any(), "some row must decode past the swap"
    P = ids.shape[1]
    for b in range(len(ids)):
        n = int(lengths[b])
        want = torch.tensor([0 if t < k else 1 for t in range(n)])
        assert torch.equal(g.token_versions[b, :n], want)
        toks = g.response_ids[b, :n]
        # tokens before the swap: the old weights' log-probs (teacher-forced)
        with torch.no_grad():
            full = old(input_ids=torch.cat([ids[b], toks])[None]).logits[0].float() / 0.9
        m = min(n, k)
        before = torch.log_softmax(full[P - 1: P - 1 + m], -1)
        assert torch.allclose(before.gather(1, toks[:m, None]).squeeze(1), g.logprobs[b, :m],
                              atol=1e-4)
        if n > k:  # after it: the new weights over the old weights' cache of the prefix
            lps = mixed_cache_logprobs(old, new, ids[b], toks, k - 1, 0.9)
            got = lps[: n - k].gather(1, toks[k:, None]).squeeze(1)
            assert torch.allclose(got, g.logprobs[b, k:n], atol=1e-4)
            # ... which differ from the new weights' own teacher-forced log-probs
            with torch.no_grad():
                tf = new(input_ids=torch.cat([ids[b], toks])[None]).logits[0].float() / 0.9
            tf = torch.log_softmax(tf[P - 1 + k: P - 1 + n], -1).gather(1, toks[k:, None])
            assert not torch.allclose(tf.squeeze(1), g.logprobs[b, k:n], atol=1e-4)


def test_a_swap_to_identical_weights_changes_no_token():
    ids, mask = prompts()
    u = sampling_uniforms(5, 0, [0, 1, 2, 3], R)
    plain = sample(tiny_lm(0), ids, mask, params(), u)
    actor = tiny_lm(0)
    swapped = sample(actor, ids, mask, params(), u, version=3,
                     between=SwapAt(actor, tiny_lm(0).state_dict(), at=2, version=4, start=3))
    assert torch.equal(plain.response_ids, swapped.response_ids)
    assert torch.allclose(plain.logprobs, swapped.logprobs, atol=1e-6)
    real = swapped.response_mask.bool()
    assert set(swapped.token_versions[real].tolist()) == {3, 4}


def test_the_rollout_version_is_the_oldest_tokens_and_weights_correct_per_token():
    ids, mask = prompts()
    pb = PromptBatch(ids, mask, torch.arange(4), torch.arange(4))
    actor, new = tiny_lm(0), tiny_lm(1)
    hook = SwapAt(actor, new.state_dict(), at=3, version=7, start=6)
    batch = generate(actor, pb, params(), seed=5, step=0, version=6, between=hook)
    assert batch.version == 6 and batch.token_versions is not None
    RolloutBatch.from_tensors(batch.to_tensors(), batch.meta())  # round-trips and validates
    # the trainer (at version 7) weights each token by pi_7 / mu, mu its own sampler's
    real = batch.loss_mask.bool()
    old_lp = batch.behaviour_logprobs.clone()
    old_lp[batch.token_versions == 6] += 0.5  # pi_7 likes the v6 tokens more than v6 did
    w = importance_weights(old_lp, batch.behaviour_logprobs, cap=1.5)
    assert torch.allclose(w[real & (batch.token_versions == 6)], torch.tensor(1.5))
    assert torch.allclose(w[real & (batch.token_versions == 7)], torch.tensor(1.0))
    m = token_version_metrics(batch, sync_version=7)
    interrupted = int(((batch.token_versions == 7).any(1)).sum())
    assert interrupted > 0 and m["partial/interrupted_rows"] == interrupted
    assert m["partial/tokens_lag/1"] == float((real & (batch.token_versions == 6)).sum())
    assert m["partial/tokens_lag/0"] == float((real & (batch.token_versions == 7)).sum())
    # without the hook: no token versions, the given version, no metrics
    plain = generate(tiny_lm(0), pb, params(), seed=5, step=0, version=6)
    assert plain.token_versions is None and plain.version == 6
    assert token_version_metrics(plain, 7) == {}


def test_token_versions_are_validated():
    ids, mask = prompts()
    pb = PromptBatch(ids, mask, torch.arange(4), torch.arange(4))
    actor = tiny_lm(0)
    batch = generate(actor, pb, params(), seed=5, step=0, version=2,
                     between=SwapAt(actor, tiny_lm(1).state_dict(), at=2, version=3, start=2))
    t, meta = batch.to_tensors(), batch.meta()
    with pytest.raises(RolloutFormatError, match="older than the batch's version"):
        RolloutBatch.from_tensors(t, {**meta, "version": 3})
    bad = t["token_versions"].clone()
    bad[t["response_mask"] == 0] = 0
    if bool((t["response_mask"] == 0).any()):
        with pytest.raises(RolloutFormatError, match="-1 on padding"):
            RolloutBatch.from_tensors({**t, "token_versions": bad}, meta)
    with pytest.raises(RolloutFormatError, match="token_versions: dtype"):
        RolloutBatch.from_tensors({**t, "token_versions": t["token_versions"].float()}, meta)
    with pytest.raises(RolloutFormatError, match="token_versions: shape"):
        RolloutBatch.from_tensors({**t, "token_versions": t["token_versions"][:, :3]}, meta)
