"""Marking what runs eagerly between graph segments."""

from __future__ import annotations

import functools
from typing import Callable, TypeVar, overload

from breakgraph.base import context
from breakgraph.base.checks import refuse_unknown_keywords, require_bool
from breakgraph.base.naming import function_name

F = TypeVar("F", bound=Callable)


@overload
def eager_on_graph(function: F) -> F: ...
@overload
def eager_on_graph(
    *, enable: bool = True, inline: Callable | bool | None = None, capture_stub: Callable | None = None
) -> Callable[[F], F]: ...


@refuse_unknown_keywords
def eager_on_graph(
    function: Callable | None = None,
    *,
    enable: bool = True,
    inline: Callable | bool | None = None,
    capture_stub: Callable | None = None,
):
    """Run ``function`` eagerly between CUDA graph segments.

    Inside a breakable capture a call ends the current segment, runs the
    function eagerly, records it, and begins a new segment; each replay
    calls it again with its capture-time argument tensors (same addresses)
    and writes its result into the capture-time result's buffers. Outside a
    capture the function is called straight through. Use it for what a CUDA
    graph cannot hold: host syncs, data-dependent shapes, JIT kernels,
    collectives, prints. Write ``@eager_on_graph`` or
    ``@eager_on_graph(enable=flag, ...)``; ``@fn.inline`` registers a
    capturable variant after the fact.

    Arguments:
        function (callable): the function to mark (given by the bare decorator).
        enable (bool, optional): False returns the function unchanged, a switch
            for A/B runs. Default: True.
        inline (callable or True, optional): what a full-graph capture
            (``breaks="inline"``) records in place of the break: a capturable
            variant with the same signature (say, attention that reads its
            lengths from a device tensor), or True when the function itself can
            be captured. The eager warm-up before a full-graph capture calls the
            variant too. Without one, a full-graph capture refuses the break,
            since it cannot tell whether the function reads host values a graph
            would freeze.
        capture_stub (callable, optional): called instead of the function while
            a breakable capture records it (a slow or collective body that
            capture need not run); every replay calls the real function, and
            writeback checks that its result has the stub's structure and shapes.
    """
    require_bool("eager_on_graph(enable=...)", enable)
    if function is None:
        return functools.partial(eager_on_graph, enable=enable, inline=inline, capture_stub=capture_stub)
    if not callable(function):
        raise TypeError(
            f"@eager_on_graph decorates a function, got {type(function).__name__}; "
            "write @eager_on_graph or @eager_on_graph(enable=flag) above a def"
        )
    for name, value in (("inline", inline), ("capture_stub", capture_stub)):
        if value is not None and value is not True and not callable(value):
            raise TypeError(f"eager_on_graph({name}=...) takes a function, got {type(value).__name__}")
    if capture_stub is True:
        raise TypeError("eager_on_graph(capture_stub=...) takes a function, got True")
    if not enable:
        return function
    name = function_name(function)

    @functools.wraps(function)
    def run(*args, **kwargs):
        capture = context.current()
        if capture is None or not capture.segment_open:
            if capture is None and callable(run.inline_variant) and context.warming_up_full_graph():
                return run.inline_variant(*args, **kwargs)
            return function(*args, **kwargs)
        return capture.run_break(function, args, kwargs, name, inline=run.inline_variant, stub=capture_stub)

    def register_inline(variant: F) -> F:
        """Decorator: ``variant`` is what full-graph captures record in place of this break."""
        if not callable(variant):
            raise TypeError(f"@{function.__name__}.inline decorates a function, got {type(variant).__name__}")
        run.inline_variant = variant
        return variant

    run.inline_variant = inline
    run.inline = register_inline
    return run


def _split_point() -> None:
    """A break with no work: the segment boundary itself."""


def break_graph() -> None:
    """End the current graph segment and begin a new one, with no eager work between.

    Outside a capture, and in a full-graph capture, it does nothing.
    """
    capture = context.current()
    if capture is not None and capture.segment_open:
        capture.run_break(_split_point, (), {}, "break_graph", inline=True)
