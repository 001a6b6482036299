"""Optional engines are extras: a chosen one that is not installed is one error naming the
extra to install."""

from __future__ import annotations

import importlib.util


class MissingExtraError(ImportError):
    """A configured engine whose optional dependency is not installed."""

    def __init__(self, backend: str, module: str, extra: str) -> None:
        super().__init__(f"backend {backend!r} needs the {module!r} package, which is not "
                         f"installed: pip install 'rlhf-async[{extra}]'")
        self.backend, self.extra = backend, extra


def require_extra(backend: str, module: str, extra: str) -> None:
    """Raise MissingExtraError unless `module` can be imported."""
    if importlib.util.find_spec(module) is None:
        raise MissingExtraError(backend, module, extra)
