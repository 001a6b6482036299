"""The text task: prompts file -> fixed-width left-padded batches; the user's reward function
loaded and checked; rule rewards in `roles.score`; config errors as one ConfigError."""

from __future__ import annotations

import json
import re

import pytest
import torch

from rlhf_async import cli
from rlhf_async.config import ConfigError, load_config
from rlhf_async.modeling.generation import generate
from rlhf_async.modeling.models import frozen_copy
from rlhf_async.rl.scoring import RewardMix, score
from rlhf_async.task import make_task, sampling_params
from rlhf_async.task.artefacts import load_sft
from rlhf_async.task.text import TextTask, heldout_split, split_key
from tests.text_model import make_text_model

PROMPTS = ["name a fruit .", "name a colour .", "list three animal .", "what is the sky ?",
           "give one fruit .", "name a big animal .", "what colour is the sea ?",
           "name a small animal .", "list three colour .", "is the sky blue ?"]
REWARD = '''
def words(prompt, response):
    return float(len(response.split()))

def raises(prompt, response):
    raise KeyError("boom")

def hangs(prompt, response):
    import threading
    threading.Event().wait()  # never returns

def exits(prompt, response):
    import sys
    sys.exit(3)

def nan(prompt, response):
    return float("nan")

def text(prompt, response):
    return "good"

def kind_is_fruit(prompt, response, kind):
    return float(kind == "fruit")

def batch_words(prompts, responses, **columns):
    CALLS.append((list(prompts), sorted(columns)))
    return [float(len(r.split())) for r in responses]

def batch_one(prompts, responses):
    return [1.0]

CALLS = []
not_a_function = 3
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("text")
    (d / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    (d / "prompts.txt").write_text("\n".join(PROMPTS) + "\n\n")
    (d / "kinds.jsonl").write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": p},
                                 {"role": "assistant", "content": "apple"}],
                    "kind": "fruit" if "fruit" in p else "other"}) + "\n" for p in PROMPTS))
    (d / "rewards.py").write_text(REWARD)
    (d / "broken.py").write_text("import not_a_module_anywhere\n")
    make_text_model(d / "model")
    make_text_model(d / "plain", chat_template=False)
    return d


def cfg_for(files, *more, prompts="prompts.jsonl", fn="words", model="model"):
    return load_config(None, [f"model.path={json.dumps(str(files / model))}", "task.name=text",
                              f"task.prompts={json.dumps(str(files / prompts))}",
                              *([] if fn is None else
                                [f"task.reward={json.dumps(str(files / 'rewards.py') + ':' + fn)}"]),
                              "generation.max_new_tokens=5", "task.max_prompt_tokens=32",
                              *more])


def test_batches_are_left_padded_to_one_width_and_keyed(files):
    task = make_task(cfg_for(files))
    assert isinstance(task, TextTask) and task.eos_id == 1 and task.pad_id == 0
    b = task.prompt_batch(3, "train", 2, count=3, group_size=2)
    assert b.prompt_ids.shape == (6, task.prompt_len) == b.prompt_mask.shape
    assert b.sample_ids.tolist() == list(range(12, 18)) and b.group_ids.tolist() == [6, 6, 7,
                                                                                       7, 8, 8]
    assert torch.equal(b.prompt_ids[0], b.prompt_ids[1])  # a group repeats its prompt
    for ids, mask in zip(b.prompt_ids, b.prompt_mask, strict=False):
        n = int(mask.sum())
        assert mask[-n:].all() and not mask[:-n].any()  # left padding
        assert ids[-n:][0] == 4 and ids[-1] == 5  # <user> ... <bot>: the chat template
        assert (ids[:-n] == task.pad_id).all()
    again = make_task(cfg_for(files)).prompt_batch(3, "train", 2, 3, 2)
    assert torch.equal(again.prompt_ids, b.prompt_ids)
    assert task.prompt_indices(4, "train", 2, 3) != task.prompt_indices(3, "train", 2, 3)


def test_each_epoch_visits_every_training_prompt_once_and_eval_is_held_out(files):
    task = make_task(cfg_for(files))
    train, held = heldout_split(PROMPTS)
    assert held and set(train).isdisjoint(held) and len(train) + len(held) == len(PROMPTS)
    n = len(train)
    seen = [i for s in range(n) for i in task.prompt_indices(0, "train", s, 1)]
    assert sorted(seen) == sorted(train)
    assert task.prompt_indices(0, "eval", 0, 100) == held
    ev = task.prompt_batch(0, "eval", 0, 100, 1)
    assert len(ev) == len(held)


def test_txt_prompts_without_chat_template(files):
    task = make_task(cfg_for(files, "task.chat_template=false", prompts="prompts.txt",
                             model="plain"))
    assert isinstance(task, TextTask) and task.prompts == PROMPTS
    assert task.prompt_len == max(len(p.split()) for p in PROMPTS)
    with pytest.raises(ConfigError, match="no chat template"):
        make_task(cfg_for(files, prompts="prompts.txt", model="plain"))


def test_rule_reward_reads_decoded_prompt_and_response_up_to_eos(files):
    task = make_task(cfg_for(files))
    assert isinstance(task, TextTask)
    b = task.prompt_batch(0, "train", 0, 2, 1)
    vocab = task.tokenizer.get_vocab()
    resp = torch.tensor([[vocab["red"], vocab["apple"], 1, 0], [vocab["cat"], 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert task.hidden_scores(b.prompt_ids, resp, mask).tolist() == [2.0, 1.0]
    i, text = task._prompt_of(b.prompt_ids[0], b.prompt_mask[0])
    assert text == PROMPTS[i] and i == task.prompt_indices(0, "train", 0, 2)[0]


def test_score_uses_the_rule_as_reward_without_a_reward_model(files):
    cfg = cfg_for(files)
    task = make_task(cfg)
    actor = load_sft(files / "model")
    batch = generate(actor, task.prompt_batch(0, "train", 0, 2, 2), sampling_params(cfg, task),
                     0, 0, 0)
    scored = score(None, frozen_copy(actor), batch, 1.0, RewardMix(task.hidden_scores))
    want = [len(task.response_text(r, m).split()) for r, m in
            zip(batch.response_ids, batch.response_mask, strict=False)]
    assert scored.rewards.tolist() == want == scored.hidden_scores.tolist()
    assert scored.ref_logprobs.shape == batch.response_ids.shape
    with pytest.raises(ValueError, match="reward model or a rule reward"):
        score(None, actor, batch, 1.0, RewardMix(None))


def test_stop_strings_end_responses_at_the_token_completing_them(files):
    cfg = cfg_for(files, "generation.max_new_tokens=8")
    task, actor = make_task(cfg), load_sft(files / "model")
    prompts = task.prompt_batch(0, "train", 0, 4, 2)
    free = generate(actor, prompts, sampling_params(cfg, task), 0, 0, 0)
    cfg = cfg_for(files, "generation.max_new_tokens=8",
                  'generation.stop_strings=["three dog", "green cat"]')
    g = generate(actor, prompts, sampling_params(cfg, task), 0, 0, 0)
    lengths = g.response_mask.sum(1).tolist()
    assert free.response_mask.sum(1).tolist() == [8, 4, 8, 8, 8, 8, 8, 7]
    assert lengths == [2, 4, 8, 5, 8, 8, 8, 7]  # rows 0 and 3 hold one of them
    assert task.response_text(g.response_ids[0], g.response_mask[0]) == "three dog"
    assert task.response_text(g.response_ids[3], g.response_mask[3]) == "small three green cat"
    for b, n in enumerate(lengths):  # the same noise: the free responses, cut
        assert torch.equal(g.response_ids[b, :n], free.response_ids[b, :n])


@pytest.mark.parametrize("fn,message", [
    ("raises", r"rewards.py:raises raised KeyError: 'boom' on prompt \d+ of task.prompts"),
    ("nan", r"rewards.py:nan returned nan on prompt \d+ .*finite number"),
    ("text", r"rewards.py:text returned 'good' \(str\) on prompt \d+ .*must return a number"),
])
def test_bad_reward_calls_name_the_function_and_prompt(files, fn, message):
    task = make_task(cfg_for(files, fn=fn))
    b = task.prompt_batch(0, "train", 0, 1, 1)
    with pytest.raises(ConfigError, match=message):
        task.hidden_scores(b.prompt_ids, torch.tensor([[7, 1]]), torch.tensor([[1, 1]]))


@pytest.mark.parametrize("spec,message", [
    ("{d}/rewards.py:missing", "has no attribute 'missing'"),
    ("{d}/rewards.py:not_a_function", "'not_a_function' is a int, not a function"),
    ("{d}/nowhere.py:f", "file .*nowhere.py' not found"),
    ("{d}/broken.py:f", "cannot import .*ModuleNotFoundError.*not_a_module_anywhere"),
    ("not_a_module_anywhere.sub:f", "cannot import 'not_a_module_anywhere.sub'"),
    ("{d}/rewards.py:", "is not 'module.path:function'"),
])
def test_reward_function_load_errors(files, spec, message):
    cfg = cfg_for(files)
    cfg.task.reward = spec.format(d=files)
    with pytest.raises(ConfigError, match=message) as e:
        make_task(cfg)
    assert e.value.problems[0].startswith("task.reward: ")


def test_config_errors_come_together(files, tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["task.name=text", "generation.max_new_tokens=2"])
    text = str(e.value)
    assert "model.path: task.name = 'text' needs" in text
    assert "task.prompts: task.name = 'text' needs prompts: a data file" in text
    assert "task.reward: task.name = 'text' needs 'module.path:function'" in text
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "name a fruit ."}\nnot json\n{"text": "x"}\n')
    cfg = cfg_for(files)
    cfg.task.prompts = str(bad)
    with pytest.raises(ConfigError) as e:
        make_task(cfg)
    assert len(e.value.problems) == 1 and "bad.jsonl:2: not JSON" in e.value.problems[0]
    bad.write_text('{"prompt": "name a fruit ."}\n{"text": "x"}\n{"prompt": ""}\n')
    with pytest.raises(ConfigError) as e:
        make_task(cfg)
    assert [p.split(": ", 2)[2][:60] for p in e.value.problems] == [
        "row 1: expected a non-empty string in 'prompt' (task.prompt_",
        "row 2: expected a non-empty string in 'prompt' (task.prompt_"]
    assert "its columns: ['text']" in e.value.problems[0]
    cfg = cfg_for(files, "task.max_prompt_tokens=4")
    with pytest.raises(ConfigError, match="over task.max_prompt_tokens = 4"):
        make_task(cfg)


def test_cli_prints_one_line_for_a_bad_reward_function(files, tmp_path, capsys):
    rc = cli.main(["run", f"model.path={json.dumps(str(files / 'model'))}", "task.name=text",
                   f"task.prompts={json.dumps(str(files / 'prompts.jsonl'))}",
                   f"task.reward={json.dumps(str(files / 'rewards.py') + ':missing')}",
                   "task.max_prompt_tokens=32",
                   f"run.output_dir={json.dumps(str(tmp_path))}", "run.progress=false"])
    err = capsys.readouterr().err
    assert rc != 0 and "has no attribute 'missing'" in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())  # no run directory for a config that cannot run


def test_module_spec_imports_from_the_working_directory(files, tmp_path, monkeypatch):
    (tmp_path / "text_task_user_rewards.py").write_text("def f(p, r):\n    return 0.5\n")
    monkeypatch.chdir(tmp_path)
    cfg = cfg_for(files)
    cfg.task.reward = "text_task_user_rewards:f"
    task = make_task(cfg)
    b = task.prompt_batch(0, "train", 0, 1, 1)
    assert task.hidden_scores(b.prompt_ids, torch.tensor([[7]]), torch.tensor([[1]])) == 0.5


def test_a_reward_that_never_returns_or_exits_is_one_error_naming_it(files, tmp_path, capsys):
    task = make_task(cfg_for(files, "task.reward_timeout_s=0.2", fn="hangs"))
    b = task.prompt_batch(0, "train", 0, 1, 1)
    prompt = task.prompts[task.prompt_indices(0, "train", 0, 1)[0]]
    with pytest.raises(ConfigError, match=r"rewards.py:hangs did not return within "
                       r"task.reward_timeout_s = 0.2 s on prompt \d+ of task.prompts \(prompt "
                       f"{re.escape(repr(prompt))}"):
        task.hidden_scores(b.prompt_ids, torch.tensor([[7, 1]]), torch.tensor([[1, 1]]))
    words = make_task(cfg_for(files))  # a stuck call leaves later calls working
    assert words.hidden_scores(b.prompt_ids, torch.tensor([[7, 1]]),
                               torch.tensor([[1, 1]])).tolist() == [1.0]
    for fn, want in (("hangs", "did not return within task.reward_timeout_s = 0.5 s on "),
                     ("exits", "called sys.exit(3) on prompt ")):
        rc = cli.main(["run", f"model.path={json.dumps(str(files / 'model'))}",
                       "task.name=text", f"task.prompts={json.dumps(str(files / 'prompts.jsonl'))}",
                       f"task.reward={json.dumps(str(files / 'rewards.py') + ':' + fn)}",
                       "task.max_prompt_tokens=32", "task.reward_timeout_s=0.5",
                       f"run.output_dir={json.dumps(str(tmp_path))}", "run.progress=false",
                       f"run.name={fn}"])
        err = capsys.readouterr().err
        assert rc == 2 and f"task.reward: {files / 'rewards.py'}:{fn} {want}" in err, err
        assert "Traceback" not in err


def test_a_model_directory_without_a_tokenizer_is_one_clear_error(files, tmp_path):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(files / "model", bare)
    for f in bare.iterdir():
        if "token" in f.name or f.name == "special_tokens_map.json":
            f.unlink()
    with pytest.raises(ConfigError, match="model.path: no usable tokenizer in .*bare"):
        make_task(cfg_for(files, f"model.path={json.dumps(str(bare))}"))


def _rows(task, texts):
    """Each prompt of `texts` once, with the response "red apple" -> (ids, response, mask)."""
    vocab = task.tokenizer.get_vocab()
    idx = [next(i for i, p in enumerate(task.prompts) if p[0]["content"] == t) for t in texts]
    ids, _ = task.encode_prompts(idx)
    resp = torch.tensor([[vocab["red"], vocab["apple"], 1]] * len(idx))
    return ids, resp, torch.ones_like(resp)


def test_chat_prompts_drop_the_answer_and_columns_reach_the_reward(files):
    task = make_task(cfg_for(files, prompts="kinds.jsonl", fn="kind_is_fruit"))
    assert isinstance(task, TextTask)
    assert task.prompts[0] == [{"role": "user", "content": PROMPTS[0]}]  # answer dropped
    assert task.columns[0]["kind"] == "fruit"
    ids, resp, mask = _rows(task, ["name a fruit .", "name a colour ."])
    assert task.hidden_scores(ids, resp, mask).tolist() == [1.0, 0.0]


def test_a_batched_reward_gets_lists_and_its_length_is_checked(files):
    task = make_task(cfg_for(files, "task.reward_batched=true", prompts="kinds.jsonl",
                             fn="batch_words"))
    ids, resp, mask = _rows(task, ["name a fruit .", "name a colour ."])
    assert task.hidden_scores(ids, resp, mask).tolist() == [2.0, 2.0]
    assert task.rule.fn.__globals__["CALLS"][-1] == (["name a fruit .", "name a colour ."],
                                                     ["kind", "messages"])
    short = make_task(cfg_for(files, "task.reward_batched=true", prompts="kinds.jsonl",
                              fn="batch_one"))
    with pytest.raises(ConfigError, match=r"task.reward: .*rewards.py:batch_one returned 1 "
                       r"values for a batch of 2 responses \(the first to prompt 0 of "
                       r"task.prompts\); with task.reward_batched it must return a list of "
                       r"one number per response \(2\)"):
        short.hidden_scores(ids, resp, mask)


def test_a_question_is_held_out_alike_as_a_prompt_string_and_as_a_chat():
    """SFT demonstrations come as chats, RL prompts as strings: the same question must be
    held out in both, or SFT trains on what RL evaluates on."""
    chats = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": p}]
             for p in PROMPTS]
    assert heldout_split([split_key(c) for c in chats]) == heldout_split(PROMPTS)


def test_a_batched_reward_of_the_wrong_length_stops_the_cli_and_leaves_no_run(files, tmp_path,
                                                                               capsys):
    rc = cli.main(["run", f"model.path={json.dumps(str(files / 'model'))}", "task.name=text",
                   f"task.prompts={json.dumps(str(files / 'kinds.jsonl'))}",
                   f"task.reward={json.dumps(str(files / 'rewards.py') + ':batch_one')}",
                   "task.reward_batched=true", "task.max_prompt_tokens=32",
                   "generation.max_new_tokens=4", "train.prompts_per_step=2",
                   "algo.group_size=2", "algo.name=grpo", "run.plot=false",
                   f"run.output_dir={json.dumps(str(tmp_path))}", "run.progress=false"])
    err = capsys.readouterr().err
    assert rc == 2 and "batch_one returned 1 values for a batch of" in err, err
    assert "Traceback" not in err and not list(tmp_path.iterdir())
