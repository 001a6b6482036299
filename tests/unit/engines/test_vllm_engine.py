"""VLLMEngine without vLLM (the main venv); the engine itself is tested in tests/vllm."""

import importlib.util
from pathlib import Path

import pytest

from rlhf_async.engines.extras import MissingExtraError
from rlhf_async.engines.vllm.engine import WORKER_EXTENSION, VLLMEngine, _finish
from rlhf_async.modeling.generation import SamplingParams


def test_missing_vllm_names_the_extra(monkeypatch):
    real = importlib.util.find_spec  # as if vllm were not installed, wherever this runs
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(MissingExtraError, match=r"pip install 'rlhf-async\[vllm\]'"):
        VLLMEngine("/nonexistent", SamplingParams(4, 0, 1), dtype="float32", tensor_parallel=1,
                   sync_backend="gloo", device="cpu")


def test_capabilities_say_what_it_cannot_do():
    caps = VLLMEngine.capabilities
    assert caps.keep_on_update and caps.prefix_cache and caps.tensor_parallel
    assert not caps.stop_strings  # no tokenizer in the engine


@pytest.mark.parametrize(("reason", "aborted", "want"), [
    ("stop", False, "stop"), ("length", False, "length"), (None, False, "length"),
    ("abort", False, "abort"), ("stop", True, "abort"), ("length", True, "abort")])
def test_finish_reasons(reason, aborted, want):
    assert _finish(reason, aborted) == want


def test_the_worker_extension_vllm_imports_in_its_workers_is_where_it_names():
    """vLLM imports WORKER_EXTENSION by its dotted name inside each worker (which this venv
    cannot start): the module exists and defines the class, without importing vllm here."""
    module, cls = WORKER_EXTENSION.rsplit(".", 1)
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    assert f"class {cls}" in Path(spec.origin).read_text()
    assert module.startswith(VLLMEngine.__module__.rsplit(".", 1)[0])  # beside the engine
