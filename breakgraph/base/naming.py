"""How breakgraph names a user's function in messages, segment names and reports."""

from __future__ import annotations

from typing import Callable


def function_name(function: Callable) -> str:
    """``function``'s qualified name, else its name, else its repr (a partial, a callable object)."""
    return getattr(function, "__qualname__", None) or getattr(function, "__name__", None) or repr(function)
