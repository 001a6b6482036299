"""Multi-turn episodes: token ids without re-tokenisation drift, the loss mask over the
policy's tokens only, keyed determinism, and environments that misbehave."""

from __future__ import annotations

import asyncio

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from rlhf_async.modeling import env_calls
from rlhf_async.modeling.env_calls import EnvError
from rlhf_async.modeling.environment import EpisodeSpec
from rlhf_async.modeling.episodes import ENDS, _observe, rollout, run_episodes
from rlhf_async.modeling.episodes import Episode as _Episode
from rlhf_async.modeling.generation import SamplingParams, generate
from rlhf_async.modeling.rollout import ENV, POLICY, PromptBatch
from rlhf_async.task.agents.environment import template_delta

TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|end|>"
            "{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n{% endif %}")
CORPUS = ["What is 2+3? Use the tool.", "calc(2+3)", "5", "calc(5*7)", "35",
          "The answer is 35.", "user assistant tool"] * 20


def _tokenizer(kind: str) -> PreTrainedTokenizerFast:
    """A GPT-2-style byte-level BPE or a Llama-style (SentencePiece-like, Metaspace) BPE,
    trained here on a few lines; both get the chat template's special tokens."""
    special = ["<|start|>", "<|end|>"]
    if kind == "gpt2":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
        alphabet, special = [], ["<unk>", *special]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=special,
                                  initial_alphabet=alphabet)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>",
                                   pad_token="<|end|>")
    fast.chat_template = TEMPLATE
    return fast


def _ids(tok, text):
    return list(tok(text, add_special_tokens=False).input_ids)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_three_turn_episode_is_the_whole_conversation_templated(kind):
    tok = _tokenizer(kind)
    chat = [{"role": "user", "content": "What is 2+3? Use the tool."}]
    turns = [("calc(2+3)", "5"), ("calc(5*7)", "35"), ("The answer is 35.", None)]
    whole = [*chat]
    for action, obs in turns:
        whole.append({"role": "assistant", "content": action})
        if obs is not None:
            whole.append({"role": "tool", "content": obs})
    want = _ids(tok, tok.apply_chat_template(whole, tokenize=False))
    prompt = _ids(tok, tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    spec = EpisodeSpec(lambda: None, dict, template_delta(tok), tok.decode, 3, 200, 1.0)
    ep = _Episode(prompt, None)  # type: ignore[arg-type]  # no environment called here
    stops = (tok.eos_token_id,)
    for k, (action, obs) in enumerate(turns):
        # the policy's tokens as sampled: the template's tokens of its turn, in context
        before = tok.decode(ep.prompt + ep.tokens)
        mine = _ids(tok, before + action)[len(_ids(tok, before)):]
        if k == 1 or obs is None:
            mine.append(tok.eos_token_id)  # this turn ended at EOS (the template's turn end)
        ep.add(mine, POLICY)
        if obs is not None:
            _observe(spec, ep, obs, stops)
    assert ep.prompt + ep.tokens == want
    assert ENV in ep.kinds and ep.kinds[-1] == POLICY


def tiny_lm(vocab=24):
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=vocab, n_positions=64, n_embd=32, n_layer=1, n_head=2,
                     bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return GPT2LMHeadModel(cfg).eval()


class CountingEnv:
    """Observation: 3 tokens' worth of text; reward 1 per step; done after 2 steps."""

    def __init__(self) -> None:
        self.steps, self.seed = 0, -1

    async def reset(self, row):
        self.seed = row["seed"]
        return ""

    async def step(self, action):
        self.steps += 1
        return "abc", 1.0, self.steps >= 2


def _spec(make_env=CountingEnv, turns=3, tokens=20, timeout=5.0):
    render = lambda obs: [20 + (ord(c) - ord("a")) for c in obs]  # noqa: E731
    return EpisodeSpec(make_env, lambda toks: {"prompt": str(toks)}, render, str, turns,
                       tokens, timeout)


def _prompts(n=4):
    ids = torch.tensor([[0, 1, 5, 6], [1, 7, 8, 9]] * (n // 2))
    sids = torch.arange(n)
    return PromptBatch(ids, (ids != 0).long(), sids, sids // 2)


def _params(spec=None):
    # stop ids 9-16: "tool call ends" (likely enough for an untrained model); EOS 2
    return SamplingParams(max_new_tokens=6, eos_id=2, pad_id=0, stop_ids=tuple(range(9, 17)),
                          episode=spec)


def test_environment_tokens_are_masked_out_of_the_loss():
    spec = _spec()
    b = run_episodes(tiny_lm(), _prompts(), _params(spec), spec, seed=3, step=1, version=0)
    assert b.response_ids.shape == (4, 20) and b.env_rewards is not None
    env = b.response_mask == ENV
    assert env.any() and (b.response_mask == POLICY).any()
    assert (b.loss_mask[env] == 0).all() and (b.behaviour_logprobs[env] == 0).all()
    assert (b.loss_mask[b.response_mask == POLICY] == 1).all()
    for row in range(4):  # every environment turn is the rendered observation
        kinds, toks = b.response_mask[row].tolist(), b.response_ids[row].tolist()
        runs = [toks[i] for i, k in enumerate(kinds) if k == ENV]
        assert runs == [20, 21, 22] * (len(runs) // 3)
        # one reward per step; an observation follows every step but the last
        assert len(runs) // 3 <= float(b.env_rewards[row]) <= len(runs) // 3 + 1
    turns = b.turns(lambda ids: ",".join(map(str, ids)))
    assert turns[0][0]["role"] == "prompt"
    assert {t["role"] for row in turns for t in row[1:]} <= {"policy", "environment"}


def test_episodes_are_keyed_by_sample_id_not_by_batch():
    spec = _spec()
    lm, p = tiny_lm(), _prompts(4)
    full = run_episodes(lm, p, _params(spec), spec, seed=3, step=1, version=0)
    pick = torch.tensor([3, 0])
    part = run_episodes(lm, PromptBatch(p.prompt_ids[pick], p.prompt_mask[pick],
                                        p.sample_ids[pick], p.group_ids[pick]),
                        _params(spec), spec, seed=3, step=1, version=0)
    assert torch.equal(part.response_ids, full.response_ids[pick])
    assert torch.equal(part.response_mask, full.response_mask[pick])


def test_one_turn_without_environment_is_generate():
    lm, p = tiny_lm(), _prompts()
    a = rollout(lm, p, _params(), seed=1, step=2, version=0)
    b = generate(lm, p, _params(), 1, 2, 0)
    assert torch.equal(a.response_ids, b.response_ids) and a.env_rewards is None


class SlowEnv(CountingEnv):
    async def step(self, action):
        await asyncio.sleep(10)
        return "", 0.0, True


class BrokenEnv(CountingEnv):
    async def step(self, action):
        return "not a tuple"


def test_a_step_past_the_timeout_ends_that_episode_only():
    spec = _spec(SlowEnv, timeout=0.2)
    b = run_episodes(tiny_lm(), _prompts(), _params(spec), spec, seed=3, step=1, version=0)
    assert not (b.response_mask == ENV).any() and float(b.env_rewards.sum()) == 0.0


def test_a_wrong_step_answer_is_one_clear_error():
    spec = _spec(BrokenEnv)
    with pytest.raises(EnvError, match=r"task.env: .*step\(\) must return"):
        run_episodes(tiny_lm(), _prompts(), _params(spec), spec, seed=3, step=1, version=0)


class DictResetEnv(CountingEnv):
    async def reset(self, row):
        return {"obs": "hello"}


class RaisingEnv(CountingEnv):
    async def step(self, action):
        return 1 / 0


def test_reset_answers_are_checked_like_step_answers():
    spec = _spec(DictResetEnv)
    with pytest.raises(EnvError, match=r"reset\(\) must return the first observation as "
                                       r"str .*got dict"):
        run_episodes(tiny_lm(), _prompts(), _params(spec), spec, seed=3, step=1, version=0)


def test_an_environment_exception_names_its_type_message_and_line():
    spec = _spec(RaisingEnv)
    with pytest.raises(EnvError) as err:
        run_episodes(tiny_lm(), _prompts(), _params(spec), spec, seed=3, step=1, version=0)
    line = RaisingEnv.step.__code__.co_firstlineno + 1
    assert "step() raised ZeroDivisionError: division by zero" in str(err.value)
    assert f"test_episodes.py:{line})" in str(err.value)


def _ends(b):
    return [ENDS[i] for i in b.episode_ends.tolist()]


def test_every_episode_ends_one_counted_way():
    spec = _spec()  # done after 2 steps, 3 turns allowed
    b = run_episodes(tiny_lm(), _prompts(), _params(spec), spec, seed=3, step=1, version=0)
    for row, how in enumerate(_ends(b)):
        stepped = float(b.env_rewards[row])  # one reward a step
        assert how == ("done" if stepped == 2 else "truncated"), (row, how, stepped)
    slow = _spec(SlowEnv, timeout=0.2)
    b = run_episodes(tiny_lm(), _prompts(), _params(slow), slow, seed=3, step=1, version=0)
    assert set(_ends(b)) <= {"timeout", "truncated"} and "timeout" in _ends(b)
    one = _spec(turns=1)
    b = run_episodes(tiny_lm(), _prompts(), _params(one), one, seed=3, step=1, version=0)
    assert set(_ends(b)) <= {"max_turns", "truncated"}


class TellingEnv(CountingEnv):
    async def step(self, action):
        self.steps += 1
        STEPPED.append(action)
        return "abc", 1.0, False


STEPPED: list = []


def test_a_turn_cut_at_the_token_limit_ends_truncated_without_a_step():
    # no stop ids and EOS never sampled before 6 tokens: every first turn hits the limit
    spec = _spec(TellingEnv)
    params = SamplingParams(max_new_tokens=6, eos_id=2, pad_id=0, min_new_tokens=6,
                            episode=spec)
    STEPPED.clear()
    b = run_episodes(tiny_lm(), _prompts(), params, spec, seed=3, step=1, version=0)
    assert _ends(b) == ["truncated"] * 4 and STEPPED == []
    assert float(b.env_rewards.sum()) == 0.0


def test_repeated_environment_warnings_become_counts(monkeypatch):
    lines = []
    monkeypatch.setattr(env_calls.log, "warning", lambda event, **kw: lines.append(kw["count"]))
    w = env_calls._Warnings(every=10)
    for _ in range(25):
        w.warn("environment call timed out", "env", call="step")
    assert lines == [1, 10, 20]
