"""Lazy public names: ``import accelkit`` stays cheap and never imports an optional backend."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(module_name: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` resolving ``names`` (public name -> module) on first use."""

    def __getattr__(name: str) -> Any:
        target = names.get(name)
        if target is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(target), name)
        return value

    return __getattr__
