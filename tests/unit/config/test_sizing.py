"""Learning rates sized to model.path (config/sizing.py): the rule, hand-valued; an explicit
value wins; the built-in model keeps its own; the resolved values say where they came
from."""

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from structlog.testing import capture_logs
from transformers import GPT2Config, GPT2LMHeadModel

from rlhf_async.cli.main import main
from rlhf_async.config import describe_sized, load_config, to_dict
from rlhf_async.config.sizing import BUILTIN_PARAMETERS, lr_scale, parameter_count
from rlhf_async.log import configure_logging
from tests.text_model import make_text_model

# SmolLM2-135M-Instruct's config.json, the parts the count reads
SMOLLM2 = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
           "tie_word_embeddings": True}


def header_only_model(d: Path, counts: list[int]) -> Path:
    """A model directory whose safetensors file holds tensors of `counts` one-byte
    elements, sparse (zeros never written): only its header is read to count."""
    d.mkdir(parents=True, exist_ok=True)
    tensors, offset = {}, 0
    for i, n in enumerate(counts):
        tensors[f"w{i}"] = {"dtype": "U8", "shape": [n], "data_offsets": [offset, offset + n]}
        offset += n
    header = json.dumps(tensors).encode()
    header += b" " * (-len(header) % 8)
    with (d / "model.safetensors").open("wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + offset)
    (d / "config.json").write_text(json.dumps(SMOLLM2))
    return d


def job(model: Path, *extra: str) -> list[str]:
    return [f"model.path={json.dumps(str(model))}", *extra]


def lrs(cfg) -> tuple[float, float, float, float]:
    return cfg.train.lr, cfg.train.critic_lr, cfg.sft.lr, cfg.reward_model.lr


def test_the_rule_by_hand():
    assert lr_scale(BUILTIN_PARAMETERS) == 1.0
    assert lr_scale(BUILTIN_PARAMETERS * 100) == pytest.approx(0.1)
    assert lr_scale(BUILTIN_PARAMETERS * 10_000) == pytest.approx(0.01)
    assert lr_scale(1_000) == 1.0  # never above the built-in model's rates


@pytest.mark.parametrize(("params", "expected"), [
    # 100x the built-in model: its rates / 10
    (BUILTIN_PARAMETERS * 100, (5e-5, 1e-4, 3e-4, 1e-4)),
    # 10,000x: / 100
    (BUILTIN_PARAMETERS * 10_000, (5e-6, 1e-5, 3e-5, 1e-5)),
    # SmolLM2-135M: sqrt(105216 / 134515008) = 0.02797; 5e-4 x that = 1.398e-5
    (134_515_008, (1.4e-5, 2.8e-5, 8.4e-5, 2.8e-5)),
])
def test_model_path_gets_learning_rates_sized_to_its_parameters(tmp_path, params, expected):
    model = header_only_model(tmp_path / "m", [params - 1000, 1000])
    assert parameter_count(model) == params
    assert lrs(load_config(None, job(model))) == pytest.approx(expected)


def test_lora_trains_at_ten_times_the_rate(tmp_path):
    model = header_only_model(tmp_path / "m", [BUILTIN_PARAMETERS * 10_000])
    cfg = load_config(None, job(model, "lora.rank=8", "lora.critic=false"))
    assert lrs(cfg) == pytest.approx((5e-5, 1e-5, 3e-5, 1e-5))  # sft and rm are full


def test_size_estimated_from_config_json_without_safetensors(tmp_path):
    """Attention with 3 KV heads of 64, a gated MLP, the embedding once (tied):
    30 x (2 x 576 x 576 + 2 x 576 x 192 + 3 x 576 x 1536) + 49152 x 576."""
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    assert parameter_count(tmp_path) == 30 * (663_552 + 221_184 + 2_654_208) + 28_311_552
    assert parameter_count(tmp_path) == 134_479_872  # the real model: 134,515,008
    assert parameter_count(tmp_path / "nothing") is None


def test_an_explicit_value_wins_from_a_file_or_an_override(tmp_path):
    model = header_only_model(tmp_path / "m", [BUILTIN_PARAMETERS * 100])
    f = tmp_path / "job.toml"
    f.write_text("[train]\nlr = 5e-4\n[sft]\nlr = 1e-5\n")
    cfg = load_config(f, job(model, "train.critic_lr=2e-3"))
    assert lrs(cfg) == pytest.approx((5e-4, 2e-3, 1e-5, 1e-4))


def test_the_builtin_model_keeps_its_rates(tmp_path):
    cfg = load_config(None, [])
    assert lrs(cfg) == (5e-4, 1e-3, 3e-3, 1e-3)
    assert describe_sized(cfg) == ""
    tiny = make_text_model(tmp_path / "tiny")  # under the built-in's size: not raised
    assert lrs(load_config(None, job(tiny))) == (5e-4, 1e-3, 3e-3, 1e-3)


def test_a_run_config_json_keeps_its_values(tmp_path):
    """Resume and Ray ranks load the run's config.json: every key is set there, so a value
    chosen then (even the built-in's) stays."""
    model = header_only_model(tmp_path / "m", [BUILTIN_PARAMETERS * 100])
    cfg = load_config(None, job(model, "train.lr=5e-4"))
    (tmp_path / "config.json").write_text(json.dumps(to_dict(cfg)))
    assert load_config(tmp_path / "config.json", []).train.lr == 5e-4


def test_resolved_values_show_where_they_came_from(tmp_path):
    model = header_only_model(tmp_path / "m", [BUILTIN_PARAMETERS * 100])
    configure_logging("info")  # the conftest's warning level would drop the info line
    with capture_logs() as logs:
        cfg = load_config(None, job(model, "train.lr=1e-3"))
    text = describe_sized(cfg)
    assert "10.5M parameters" in text
    assert "train.lr = 0.001  set in the config (sized would be 5e-05)" in text
    assert "train.critic_lr = 0.0001  sized to the model (0.001 x 0.1)" in text
    sized = [e for e in logs if e["event"] == "defaults sized to model.path"]
    assert len(sized) == 1 and sized[0]["train.critic_lr"] == 1e-4
    assert "train.lr" not in sized[0]  # the user's, not sized


def test_dry_run_shows_the_sized_values(tmp_path, capsys):
    model = make_text_model(tmp_path / "m")
    with torch.random.fork_rng():  # a GPT-2 of ~400k parameters on the same tokenizer
        torch.manual_seed(0)
        GPT2LMHeadModel(GPT2Config(vocab_size=35, n_positions=64, n_embd=128, n_layer=2,
                                   n_head=2)).save_pretrained(model)
    (tmp_path / "p.jsonl").write_text('{"prompt": "name a fruit ."}\n' * 8)
    (tmp_path / "r.py").write_text("def reward(prompt, response):\n    return 0.0\n")
    rc = main(["run", "--dry-run", *job(model, "task.name=text",
                                        f"task.prompts={tmp_path / 'p.jsonl'}",
                                        f"task.reward={tmp_path / 'r.py'}:reward",
                                        f"run.output_dir={tmp_path / 'runs'}")])
    out = capsys.readouterr().out
    n = parameter_count(model)
    assert rc == 0 and n is not None and n > BUILTIN_PARAMETERS
    lr = float(f"{5e-4 * lr_scale(n):.2g}")
    assert f"train.lr = {lr:g}  sized to the model" in out
    assert not (tmp_path / "runs").exists()


def test_save_file_models_are_counted_exactly(tmp_path):
    save_file({"a": torch.zeros(3, 4), "b": torch.zeros(5)}, tmp_path / "model.safetensors")
    assert parameter_count(tmp_path) == 17
