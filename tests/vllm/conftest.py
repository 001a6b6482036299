"""tests/vllm runs only in the vLLM venv (`.ci/run` builds `.venv-vllm`): the main suite
does not collect it (pyproject `norecursedirs`); without vllm each module here skips."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the project may be installed elsewhere in that venv
    sys.path.insert(0, str(ROOT))
