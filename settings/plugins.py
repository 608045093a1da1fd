"""Extension points named `module:Name` (a scheduling policy, a routing function, an attention backend, a tool-call
or reasoning parser): one way to load them, and one shape for the error that says why one cannot be."""

from __future__ import annotations

import importlib
from typing import Any, TypeVar

T = TypeVar("T")


def load_named(spec: str, what: str) -> Any:
    """The object `spec` ("package.module:Name") names; ValueError naming `what` and `spec` otherwise."""
    module_name, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as exc:  # ValueError: an empty module name
        raise ValueError(f"cannot load {what} {spec!r}: {exc}") from exc


def load_subclass(spec: str, base: type[T], what: str) -> type[T]:
    """The class `spec` names, which must subclass `base`; ValueError otherwise."""
    cls = load_named(spec, what)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(f"{what} {spec!r} is not a subclass of {base.__module__}.{base.__qualname__}")
    return cls
