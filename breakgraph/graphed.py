"""The callable form: capture ``fn`` on static arguments once, replay it many times."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch

from breakgraph.capture import BreakableCUDAGraph, BreakableCUDAGraphCapture, _default_capture_stream
from breakgraph.config import capture_disabled, cuda_available, debug_requested
from breakgraph.eager import eager_on_graph


def eager_fallback_reason() -> str | None:
    """Why callable forms run eagerly here (no GPU, or BREAKGRAPH_DISABLE=1), or None."""
    if capture_disabled():
        return "BREAKGRAPH_DISABLE=1 is set"
    if not cuda_available():
        return "no CUDA GPU is available"
    return None


class GraphedCallable:
    """``fn`` captured on static arguments; :meth:`replay` re-runs it and returns its static output.

    Refill the static argument tensors in place (``x.copy_(new)``) between
    replays. The returned output is the capture-time object, refreshed by
    every replay: copy what you must keep.
    """

    def __init__(
        self, fn: Callable, args: tuple, kwargs: dict, *, debug: bool | None, pool, warmup: int, random_ops: str = "break"
    ):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.debug = debug_requested(debug)
        self.output: Any = None
        self.graph: BreakableCUDAGraph | None = None
        reason = eager_fallback_reason()
        if reason is not None:
            warnings.warn(f"breakgraph: {reason}; {_name(fn)} runs eagerly on every replay", stacklevel=3)
            return
        self.graph = BreakableCUDAGraph(pool=pool, debug=self.debug)
        # Debug mode: the whole function is one eager break, replayed through the same path.
        target = eager_on_graph(fn) if self.debug else fn
        stream = _default_capture_stream(torch.device("cuda", torch.cuda.current_device()))
        if warmup:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(warmup):
                    fn(*args, **kwargs)
            torch.cuda.current_stream().wait_stream(stream)
        with BreakableCUDAGraphCapture(self.graph, stream=stream, random_ops=random_ops):
            self.output = target(*args, **kwargs)

    @property
    def eager(self) -> bool:
        """True when this callable runs ``fn`` eagerly instead of replaying a graph."""
        return self.graph is None

    def replay(self):
        if self.graph is None:
            return self.fn(*self.args, **self.kwargs)
        self.graph.replay()
        return self.output

    __call__ = replay


def _name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", repr(fn))


def graphed(
    fn: Callable,
    *static_args,
    debug: bool | None = None,
    pool=None,
    warmup: int = 1,
    random_ops: str = "break",
    **static_kwargs,
) -> GraphedCallable:
    """Capture ``fn(*static_args, **static_kwargs)`` as a breakable graph.

    ``fn`` first runs ``warmup`` times eagerly on the capture stream (lazy
    library initialisation must not happen inside a capture; pass 0 if it has
    side effects that must not repeat). ``debug`` (default ``BREAKGRAPH_DEBUG``)
    makes the whole function one eager break replayed through the same code
    path, with debug checks. ``random_ops`` is as for
    :class:`BreakableCUDAGraphCapture`. Without a GPU, or with
    ``BREAKGRAPH_DISABLE=1``, replay calls ``fn`` eagerly (one warning).
    """
    return GraphedCallable(fn, static_args, static_kwargs, debug=debug, pool=pool, warmup=warmup, random_ops=random_ops)
