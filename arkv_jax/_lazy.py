"""Module attributes loaded on first use (PEP 562), for package exports that import heavy modules."""

from __future__ import annotations

import importlib
from typing import Callable, Mapping


def lazy_exports(module: str, exports: Mapping[str, str], names: list[str]
                 ) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for module ``module``: attribute ``name`` in ``exports`` is
    ``getattr(import_module(exports[name]), name)``; ``dir()`` lists the module's globals and
    ``names`` (its ``__all__``)."""
    def __getattr__(name: str):
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        import sys

        return sorted(set(vars(sys.modules[module])) | set(names))

    return __getattr__, __dir__
