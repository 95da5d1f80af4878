"""Marking what runs eagerly between graph segments."""

from __future__ import annotations

import functools
from typing import Callable, TypeVar, overload

from breakgraph import context

F = TypeVar("F", bound=Callable)


@overload
def eager_on_graph(function: F) -> F: ...
@overload
def eager_on_graph(*, enable: bool = True) -> Callable[[F], F]: ...


def eager_on_graph(function=None, *, enable: bool = True):
    """Run ``function`` eagerly between CUDA graph segments.

    Inside a breakable capture a call ends the current segment, runs the
    function eagerly, records it, and begins a new segment; each replay
    calls it again with its capture-time argument tensors (same addresses)
    and writes its result into the capture-time result's buffers. Outside a
    capture the function is called straight through.

    Use it for what a CUDA graph cannot hold: host syncs, data-dependent
    shapes, JIT kernels, collectives, prints. ``enable=False`` returns the
    function unchanged (a switch for A/B runs).
    """
    if function is None:
        return functools.partial(eager_on_graph, enable=enable)
    if not callable(function):
        raise TypeError(
            f"@eager_on_graph decorates a function, got {type(function).__name__}; "
            "write @eager_on_graph or @eager_on_graph(enable=flag) above a def"
        )
    if not enable:
        return function

    @functools.wraps(function)
    def run(*args, **kwargs):
        capture = context.current()
        if capture is None or not capture.segment_open:
            return function(*args, **kwargs)
        return capture.run_break(function, args, kwargs)

    return run


def _split_point() -> None:
    """A break with no work: the segment boundary itself."""


def break_graph() -> None:
    """End the current graph segment and begin a new one, with no eager work between.

    Outside a capture it does nothing.
    """
    capture = context.current()
    if capture is not None and capture.segment_open:
        capture.run_break(_split_point, (), {}, name="break_graph")
