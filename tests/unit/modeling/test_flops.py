"""Model FLOPs and MFU of one step, valued by hand for a 2-layer, 8-wide GPT-2."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from rlhf_async.modeling.flops import (
    TOKEN_KEYS,
    FlopShape,
    Utilization,
    gpu_kind,
    shape_of_dir,
    token_counts,
    train_flops,
    train_passes,
)
from rlhf_async.modeling.models import ScalarHeadModel, scalar_model_from_actor

# per layer: c_attn 8x24 + attn c_proj 8x8 + c_fc 8x32 + mlp c_proj 32x8 = 768 = 12 h^2
DENSE, HEAD, LAYERS, WIDTH = 2 * 768, 10 * 8, 2, 8


@pytest.fixture
def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=10, n_positions=16, n_embd=8, n_layer=2,
                                      n_head=2))


def test_shape_counts_dense_weights_not_embeddings(gpt2, tmp_path):
    assert FlopShape.of_module(gpt2) == FlopShape(DENSE, HEAD, LAYERS, WIDTH)
    critic = scalar_model_from_actor(gpt2, 0)  # a scalar head: hidden weights
    assert FlopShape.of_module(critic) == FlopShape(DENSE, 8, LAYERS, WIDTH)
    gpt2.save_pretrained(tmp_path / "lm")
    critic.save(tmp_path / "rm")
    assert shape_of_dir(tmp_path / "lm", lm=True) == FlopShape(DENSE, HEAD, LAYERS, WIDTH)
    assert shape_of_dir(tmp_path / "rm", lm=False) == FlopShape(DENSE, 8, LAYERS, WIDTH)
    assert isinstance(ScalarHeadModel.load(tmp_path / "rm"), ScalarHeadModel)


def test_token_counts_of_padded_rows():
    # row A: prompt 3, response 2; row B: prompt 2 (one pad left), response 1 (one pad)
    prompt_mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    response_mask = torch.tensor([[1, 1], [1, 0]])
    c = {k: float(v.sum()) for k, v in token_counts(prompt_mask, response_mask).items()}
    # decode: A's 2nd token is one forward attending 4 positions; B's only token none
    assert c == {"tokens/prompt": 5, "tokens/response": 3, "tokens/decoded": 1,
                 "attn_pairs/prefill": 6 + 3, "attn_pairs/decode": 4,
                 "attn_pairs/full": 15 + 6}


def test_mfu_of_one_step_by_hand():
    lm, scalar = FlopShape(DENSE, HEAD, LAYERS, WIDTH), FlopShape(DENSE, 8, LAYERS, WIDTH)
    counts = dict(zip(TOKEN_KEYS, (5.0, 3.0, 1.0, 9.0, 4.0, 21.0), strict=True))
    # PPO-less GRPO, 1 epoch, a separate old-log-prob forward: 4 forward-equivalents
    passes = train_passes(epochs=1, old_forward=True, recompute=False)
    assert passes == 4 and train_passes(2, False, True) == 8
    flops_train = train_flops(lm, None, passes, counts)
    # one forward over 8 positions, 21 attention pairs, the LM head at the 3 response tokens
    assert flops_train == 4 * (2 * DENSE * 8 + 4 * 2 * 8 * 21 + 2 * HEAD * 3) == 105600
    record = {**counts, "samples": 2.0, "flops/train": flops_train, "time_step": 32.0}
    u = Utilization(actor=lm, reward=scalar, reference=lm, teacher=None, peak=1e4, devices=1)
    f = u.flops(record)
    # prefill 5 + decode 1 positions, 9 + 4 pairs, the head for each of the 3 sampled tokens
    assert f["generate"] == 2 * DENSE * 6 + 4 * 2 * 8 * 13 + 2 * HEAD * 3 == 19744
    # reward: whole sequences, its scalar head read once a row; reference: the LM head at
    # every response token
    assert f["score"] == (24576 + 1344 + 2 * 8 * 2) + (24576 + 1344 + 480) == 52352
    out = u.of(record, {"generate": 4.0, "score": 8.0, "train": 20.0})
    assert out == pytest.approx({"mfu/generate": 19744 / 4e4, "mfu/score": 52352 / 8e4,
                                 "mfu/train": 105600 / 2e5,
                                 "mfu/step": (19744 + 52352 + 105600) / 32e4,
                                 "tokens_per_s_per_device": 8 / 32})
    # two devices: the step's wall time counts on both
    two = Utilization(lm, scalar, lm, None, 1e4, 2).of(record, {})
    assert two["mfu/step"] == pytest.approx(out["mfu/step"] / 2)
    assert "mfu/generate" not in two  # no busy time given: no stage figure
    assert u.of({"step": 0, "time_step": 1.0}, {}) == {}  # a restored record: no counts
    assert Utilization(lm, scalar, lm, None, 0.0, 1).of(record, {}) == {}  # no peak


def test_gpu_kind_of_device_names():
    assert gpu_kind("NVIDIA H100 80GB HBM3") == "H100"
    assert gpu_kind("NVIDIA H200") == "H200"
    assert gpu_kind("NVIDIA A100-SXM4-80GB") == "A100"
    assert gpu_kind("Tesla T4") is None
