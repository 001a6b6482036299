"""SFT -> reward model -> PPO on the user's data, the way a user chains them: `rlhf-async
sft` on chat demonstrations (.jsonl), `rlhf-async rm` on preference pairs (.parquet),
`rlhf-async run` on a save_to_disk prompts dataset whose extra column reaches a batched
rule; each output loads with from_pretrained, each bad input is one error and writes
nothing."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

import rlhf_async
from rlhf_async import cli
from rlhf_async.config import ConfigError
from rlhf_async.modeling.models import load_scalar_model
from tests.text_model import make_text_model

datasets = pytest.importorskip("datasets")
pytestmark = [pytest.mark.timeout(300)]

WORDS = {"fruit": ["apple", "pear"], "animal": ["cat", "dog"], "colour": ["red", "blue"]}
PROMPTS = {"name a fruit .": "fruit", "give one fruit .": "fruit", "name a big animal .":
           "animal", "name a small animal .": "animal", "name a colour .": "colour",
           "what colour is the sea ?": "colour", "what is the sky ?": "colour",
           "list three animal .": "animal", "is the sky blue ?": "colour"}
RULE = f'''
WORDS = {WORDS!r}

def right_kind(prompts, responses, kind):
    return [float(r.split(" ")[0] in WORDS[k]) if r else 0.0 for r, k in zip(responses, kind)]
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("stages")
    make_text_model(d / "model")
    demos = [{"messages": [{"role": "user", "content": p},
                           {"role": "assistant", "content": w}]}
             for p, k in PROMPTS.items() for w in WORDS[k]]
    (d / "demos.jsonl").write_text("".join(json.dumps(r) + "\n" for r in demos))
    every = [w for ws in WORDS.values() for w in ws]
    pairs = [{"prompt": p, "chosen": good, "rejected": bad} for p, k in PROMPTS.items()
             for good in WORDS[k] for bad in every if bad not in WORDS[k]]
    datasets.Dataset.from_list(pairs).to_parquet(str(d / "pairs.parquet"))
    datasets.Dataset.from_list([{"prompt": p, "kind": k} for p, k in PROMPTS.items()]) \
        .save_to_disk(str(d / "prompts"))
    (d / "rule.py").write_text(RULE)
    return d


def _common(files, tmp_path, name):
    return [f"run.output_dir={json.dumps(str(tmp_path / 'runs'))}", f"run.name={name}",
            "run.progress=false", "run.plot=false"]


def test_sft_then_rm_then_ppo_on_the_users_files(files, tmp_path, capsys):
    assert cli.main(["sft", f"model.path={files / 'model'}", f"sft.data={files / 'demos.jsonl'}",
                     "sft.steps=40", "sft.batch_size=8", *_common(files, tmp_path, "sft")]) == 0
    sft = json.loads((tmp_path / "runs" / "sft" / "summary.json").read_text())
    assert "next: model.path=" in capsys.readouterr().out
    assert sft["heldout_loss_after"] < 0.5 * sft["heldout_loss_before"]
    assert len((tmp_path / "runs" / "sft" / "metrics.jsonl").read_text().splitlines()) == 40
    AutoModelForCausalLM.from_pretrained(sft["model"])  # loads as any HF model

    rm = rlhf_async.reward_model(None, [f"model.path={sft['model']}",
                                        f"reward_model.data={files / 'pairs.parquet'}",
                                        "reward_model.steps=200", "reward_model.batch_size=16",
                                        "reward_model.lr=1e-3", *_common(files, tmp_path, "rm")])
    assert rm["heldout_accuracy_after"] >= 0.75 and rm["heldout_rows"] > 0
    hf = AutoModelForSequenceClassification.from_pretrained(rm["model"])
    assert hf.config.num_labels == 1
    ours = load_scalar_model(rm["model"])  # reward_model.path reads it back, same scores
    ids = torch.tensor([[4, 10, 6, 5, 20]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        assert torch.allclose(hf(input_ids=ids).logits[0, 0],
                              ours(ids, mask, mask.cumsum(1) - 1)[0, -1], atol=1e-5)

    summary = rlhf_async.train(None, [
        f"model.path={sft['model']}", f"reward_model.path={rm['model']}", "task.name=text",
        f"task.prompts={files / 'prompts'}", f"task.reward={files / 'rule.py'}:right_kind",
        "task.reward_batched=true", "generation.max_new_tokens=3", "task.max_prompt_tokens=16",
        "train.steps=2", "train.prompts_per_step=4", "algo.group_size=2", "algo.name=ppo",
        "run.eval_prompts=8", *_common(files, tmp_path, "ppo")])
    assert summary["reward_model"] == rm["model"] and summary["has_rule"]
    assert 0.0 <= summary["final_hidden_score"] <= 1.0  # the batched rule, with its column


def _write(rows, path):
    """`rows` in the format `path`'s suffix names (a directory: save_to_disk)."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return
    ds = datasets.Dataset.from_list(rows)
    {".json": lambda: path.write_text(json.dumps(rows)), ".parquet": lambda: ds.to_parquet(
        str(path)), ".csv": lambda: ds.to_csv(str(path), index=False),
     "": lambda: ds.save_to_disk(str(path))}[path.suffix]()


def _chain(files, tmp_path, fmt):
    """sft -> rm -> ppo (a few steps each) with all three inputs in format `fmt`."""
    d = tmp_path / fmt.strip(".") if fmt else tmp_path / "saved"
    d.mkdir()
    demos = [{"prompt": p, "response": w} for p, k in PROMPTS.items() for w in WORDS[k]]
    pairs = [{"prompt": p, "chosen": WORDS[k][0], "rejected": "cat" if k != "animal" else
              "red"} for p, k in PROMPTS.items()]
    prompts = [{"prompt": p, "kind": k} for p, k in PROMPTS.items()]
    for name, rows in (("demos", demos), ("pairs", pairs), ("prompts", prompts)):
        _write(rows, d / f"{name}{fmt}")
    common = [f"run.output_dir={json.dumps(str(d / 'runs'))}", "run.progress=false",
              "run.plot=false"]
    sft = rlhf_async.sft(None, [f"model.path={files / 'model'}", "run.name=sft",
                                f"sft.data={d / ('demos' + fmt)}", "sft.steps=3", *common])
    rm = rlhf_async.reward_model(None, [f"model.path={sft['model']}", "run.name=rm",
                                        f"reward_model.data={d / ('pairs' + fmt)}",
                                        "reward_model.steps=3", *common])
    ppo = rlhf_async.train(None, [
        f"model.path={sft['model']}", f"reward_model.path={rm['model']}", "task.name=text",
        f"task.prompts={d / ('prompts' + fmt)}", f"task.reward={files / 'rule.py'}:right_kind",
        "task.reward_batched=true", "generation.max_new_tokens=3", "task.max_prompt_tokens=16",
        "train.steps=1", "train.prompts_per_step=2", "algo.group_size=2", "algo.name=grpo",
        "run.eval_prompts=8", "run.name=ppo", *common])
    return (sft["heldout_loss_after"], rm["heldout_accuracy_after"], rm["final_loss"],
            ppo["final_reward"], ppo["final_hidden_score"])


def test_every_data_format_trains_the_same_chain(files, tmp_path):
    """The same rows as .jsonl, .json, .parquet, .csv and a save_to_disk directory: the
    three stages give the same numbers (the formats only change how rows are read)."""
    results = {fmt: _chain(files, tmp_path, fmt) for fmt in (".jsonl", ".json", ".parquet",
                                                               ".csv", "")}
    first = results[".jsonl"]
    assert all(r == pytest.approx(first) for r in results.values()), results


@pytest.mark.parametrize("rows, message", [
    ([{"prompt": "name a fruit .", "answer": "apple"}] * 3,
     r"sft.data: .*bad.jsonl: row 0: expected non-empty strings in 'prompt' and 'response' "
     r"\(sft.prompt_key, sft.response_key\) or a chat in 'messages' \(sft.messages_key\); its "
     r"columns: \['answer', 'prompt'\]"),
    ([{"messages": [{"role": "user", "content": "name a fruit ."}]}] * 2,
     r"sft.data: .*row 0 \('messages'\): the chat's last turn is not the assistant's"),
    ([{"messages": [{"role": "assistant", "content": "apple"}]}] * 2,
     r"row 0: the chat in 'messages' has no turn before the response"),
    ([{"messages": "name a fruit"}] * 2, r"row 0 \('messages'\): expected a chat"),
    ([], r"sft.data: .*bad.jsonl' holds no rows"),
    ([{"prompt": "name a fruit .", "response": "apple"}],
     r"holds 1 row\(s\); training needs >= 2"),
    ([{"prompt": " ".join(["name"] * 80), "response": "apple"}] * 2,
     r"row 0: the prompt is \d+ tokens, which leaves no room for a response within 64 tokens"),
])
def test_bad_demonstrations_are_one_error_and_write_nothing(files, tmp_path, capsys, rows,
                                                            message):
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc = cli.main(["sft", f"model.path={files / 'model'}", f"sft.data={tmp_path / 'bad.jsonl'}",
                   *_common(files, tmp_path, "x")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert re.search(message, err), err
    assert not (tmp_path / "runs").exists()


def test_bad_pairs_and_missing_inputs_are_one_error(files, tmp_path):
    base = [f"model.path={files / 'model'}", *_common(files, tmp_path, "x")]
    (tmp_path / "pairs.jsonl").write_text(json.dumps({"prompt": "a", "chosen": "b"}) + "\n")
    with pytest.raises(ConfigError, match=r"reward_model.data: .*row 0: no 'rejected' "
                       r"\(reward_model.chosen_key / rejected_key\); its columns: \['chosen', "
                       r"'prompt'\]"):
        rlhf_async.reward_model(None, [*base, f"reward_model.data={tmp_path / 'pairs.jsonl'}"])
    chat = [{"role": "user", "content": "a"}]
    (tmp_path / "pairs.jsonl").write_text(json.dumps({
        "chosen": [*chat, {"role": "assistant", "content": "b"}],
        "rejected": [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}],
    }) + "\n")
    with pytest.raises(ConfigError, match="differ before their last turn"):
        rlhf_async.reward_model(None, [*base, f"reward_model.data={tmp_path / 'pairs.jsonl'}"])
    with pytest.raises(ConfigError, match=r"reward_model.data: `rlhf-async rm` needs your "
                       "data"):
        rlhf_async.reward_model(None, base)
    with pytest.raises(ConfigError, match="model.path: `rlhf-async sft` trains a model of "
                       "yours"):
        rlhf_async.sft(None, [f"sft.data={files / 'demos.jsonl'}"])
    assert not (tmp_path / "runs").exists()


def test_the_smollm2_examples_data_reads_as_its_stages_read_it(files):
    """examples/smollm2_rlhf/ (its run needs the SmolLM2 download; its data must not):
    every demonstration and pair parses, with the policy's tokenizer swapped for ours."""
    from pathlib import Path

    from rlhf_async.config import load_config
    from rlhf_async.task.sources.tokens import load_tokenizer
    from rlhf_async.task.sources.user_data import demonstration, preference, tokenise

    root = Path(__file__).parents[2]
    cfg = load_config(root / "deploy" / "configs" / "smollm2_rlhf.toml",
                      [f"model.path={files / 'model'}", "task.max_prompt_tokens=32"],
                      base_dir=root)
    tok = load_tokenizer(cfg.model.path)
    for key, section, parse in (("sft.data", cfg.sft, demonstration),
                                ("reward_model.data", cfg.reward_model, preference)):
        data = tokenise(key, section.data, section.split, parse, section, tok, True, 64)
        rows = len(Path(section.data).read_text().splitlines())
        assert data.stats()["rows"] == rows > 50
        assert data.stats()["heldout_rows"] > 0
