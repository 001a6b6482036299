"""VLLMEngine without vLLM (the main venv); the engine itself is tested in tests/vllm."""

import importlib.util

import pytest

from rlhf_async.engines.extras import MissingExtraError
from rlhf_async.engines.vllm.engine import VLLMEngine, _finish
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
