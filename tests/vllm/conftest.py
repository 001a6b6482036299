"""tests/vllm runs only in the vLLM venv (`.ci/run` builds `.venv-vllm`): the main suite
does not collect it (pyproject `norecursedirs`); without vllm each module here skips.
The engine the tests share (`serving.py`) starts once a session."""

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the project may be installed elsewhere in that venv
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; a shared box


@pytest.fixture(scope="session")
def served(tmp_path_factory) -> Iterator[Any]:  # a serving.Served (that module needs vllm)
    import torch

    from tests.vllm.serving import Served

    torch.set_num_threads(1)
    s = Served(str(tmp_path_factory.mktemp("gpt2")))
    yield s
    s.close()
