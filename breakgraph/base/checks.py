"""How an option is checked: one message shape for every option of every entry point.

Each check names the option, the value given and what is allowed, so that
``lazy="no"`` is refused rather than read as true. The options themselves,
and which check each one gets, live in :mod:`breakgraph.base.options`.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import numbers
from typing import Any, Callable, Iterable, TypeVar

F = TypeVar("F", bound=Callable)


def _given(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def require_bool(name: str, value: Any) -> bool:
    """``value`` when it is True or False; strings and numbers are refused, not read as truth."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {_given(value)}")
    return value


def require_optional_bool(name: str, value: Any, meaning_of_none: str) -> bool | None:
    """``value`` when it is True, False or None."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name} must be True, False or None ({meaning_of_none}), got {_given(value)}")
    return value


def require_number(name: str, value: Any) -> int | float:
    """A real number (int or float); True, False, strings and tensors are refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number (int or float), got {_given(value)}")
    return value


def require_count(name: str, value: Any, least: int = 1) -> int:
    """A whole number of at least ``least`` (True and False are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be a whole number >= {least}, got {_given(value)}")
    return value


def require_choice(name: str, value: Any, choices: Iterable[str]) -> str:
    """One of ``choices``."""
    choices = tuple(choices)
    if value not in choices:
        allowed = ", ".join(repr(choice) for choice in choices)
        raise ValueError(f"{name} must be one of {allowed}, got {_given(value)}")
    return value


def require_callable(name: str, value: Any) -> Any:
    """A callable or None."""
    if value is not None and not callable(value):
        raise TypeError(f"{name} must be callable or None, got {_given(value)}")
    return value


def near_miss(name: str, known: Iterable[str]) -> str | None:
    """The known name ``name`` is most likely a misspelling of, or None."""
    matches = difflib.get_close_matches(name, list(known), n=1, cutoff=0.75)
    return matches[0] if matches else None


def refuse_unknown(owner: str, names: Iterable[str], known: Iterable[str]) -> None:
    """Refuse option names ``owner`` does not take, naming the closest one it does."""
    known = tuple(known)
    for name in names:
        if name not in known:
            guess = near_miss(name, known)
            hint = f"; did you mean {guess!r}?" if guess else f"; it takes {', '.join(known)}"
            raise TypeError(f"{owner} got an unknown option {name!r}{hint}")


def refuse_unknown_keywords(function: F) -> F:
    """``function``, refusing a keyword it does not take by naming the closest one it does, which
    Python's own "unexpected keyword argument" does not (for a function without ``**kwargs``)."""
    by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    known = tuple(name for name, param in inspect.signature(function).parameters.items() if param.kind in by_name)

    @functools.wraps(function)
    def checked(*args: Any, **kwargs: Any) -> Any:
        refuse_unknown(function.__name__, kwargs, known)
        return function(*args, **kwargs)

    return checked
