"""A 3-turn episode on the real (CPU) vLLM engine, scheduled by the generator node's
`Scheduler`: the token ids trained on (prompt + every turn, the environment's as the chat
template's deltas) are the chat template over the whole conversation, tokenised once.

The tokenizer is one token per character (plus the template's two special tokens), so any
sampled sequence decodes and re-tokenises to itself and the comparison is exact. The policy
served is the shared engine's GPT-2 with its final layer norm flattened to a constant and
the EOS embedding aligned with it: after `min_new_tokens` every turn ends in EOS (the
template's turn end), before that its tokens are random characters.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vllm is not installed (tests/vllm need the vLLM venv)")

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from nodes.generator.inflight import Weights
from nodes.generator.scheduler import Scheduler
from rlhf_async.modeling.environment import EpisodeSpec
from rlhf_async.modeling.generation import SamplingParams
from rlhf_async.modeling.rollout import ENV, POLICY, PromptBatch
from rlhf_async.pipeline.protocol import ChunkId
from rlhf_async.task.agents.environment import template_delta
from tests.vllm.serving import EOS, TEMPERATURE, VOCAB, Served, gpt2

TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|end|>"
            "{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n{% endif %}")
OBSERVATIONS = ["5", "35"]  # the tool's answers to turns 1 and 2; turn 3 ends the episode


def _tokenizer() -> PreTrainedTokenizerFast:
    chars = ["\n", *(chr(c) for c in range(32, 125))]  # ids 2..95
    vocab = {"<|start|>": 0, "<|end|>": EOS, **{c: i + 2 for i, c in enumerate(chars)}}
    assert len(vocab) == VOCAB
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>",
                                   pad_token="<|start|>", clean_up_tokenization_spaces=False,
                                   additional_special_tokens=["<|start|>"])
    fast.chat_template = TEMPLATE
    return fast


def _ends_in_eos() -> torch.nn.Module:
    """Every position's logits: random ones of spread ~1, EOS's ~12 above them."""
    model = gpt2(7)
    with torch.no_grad():
        h = torch.randn(model.config.n_embd)
        h = 10 * h / h.norm()
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.copy_(h)  # the final hidden state, at every position
        model.transformer.wte.weight[EOS] = 1.2 * h / h.norm()  # tied: EOS's logit 12
    return model


class Tool:
    """Answers turn k with OBSERVATIONS[k]; done at the third action. Records the actions."""

    def __init__(self) -> None:
        self.actions: list[str] = []

    async def reset(self, row: dict) -> str:
        return ""

    async def step(self, action: str) -> tuple[str, float, bool]:
        self.actions.append(action)
        k = len(self.actions) - 1
        return (OBSERVATIONS[k], 0.0, False) if k < 2 else ("", 1.0, True)


def test_a_three_turn_episode_is_the_whole_conversation_templated(served: Served) -> None:
    version = served.engine.version + 1
    staged = served.send(version, 0, _ends_in_eos())
    assert served.run(served.engine.commit(staged["plan"])) == version
    staged["thread"].join()

    tok = _tokenizer()
    user = [{"role": "user", "content": "What is 5*7? Use the tool."}]
    prompt = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([list(tok(prompt, add_special_tokens=False).input_ids)] * 2)
    prompts = PromptBatch(ids, torch.ones_like(ids), torch.arange(2), torch.arange(2))
    tools: list[Tool] = []

    def make_env() -> Tool:
        tools.append(Tool())
        return tools[-1]

    spec = EpisodeSpec(make_env, lambda p: {}, template_delta(tok), tok.decode, max_turns=3,
                       max_tokens=120, timeout_s=30.0)
    params = SamplingParams(max_new_tokens=12, eos_id=EOS, pad_id=0, min_new_tokens=4,
                            temperature=TEMPERATURE, episode=spec)

    async def play():
        weights = Weights(served.engine, partial=False)
        sched = Scheduler(served.engine, weights, params, seed=3, slots=None)
        return await sched.episodes(ChunkId(0, 0, 1), prompts, spec)

    batch, _ = served.run(play())
    responses = []
    for i in range(2):
        n = int((batch.response_mask[i] != 0).sum())  # POLICY and ENV tokens, then padding
        got = batch.prompt_ids[i].tolist() + batch.response_ids[i, :n].tolist()
        # each turn's content: its action without the EOS that ended it
        actions = [a.removesuffix("<|end|>") for a in tools[i].actions]
        assert len(actions) == 3 and all(len(a) >= 4 for a in actions), actions
        whole = [*user]
        for k, action in enumerate(actions):
            whole.append({"role": "assistant", "content": action})
            if k < 2:
                whole.append({"role": "tool", "content": OBSERVATIONS[k]})
        want = tok(tok.apply_chat_template(whole, tokenize=False),
                   add_special_tokens=False).input_ids
        assert got == list(want)
        kinds = batch.response_mask[i, :n].tolist()
        env = [f"<|start|>tool\n{o}<|end|><|start|>assistant\n" for o in OBSERVATIONS]
        assert kinds.count(ENV) == sum(len(tok(e, add_special_tokens=False).input_ids)
                                       for e in env)
        assert kinds[-1] == POLICY and got[-1] == EOS
        responses.append(actions)
    assert responses[0] != responses[1]  # two episodes, sampled apart (keyed per sample id)
