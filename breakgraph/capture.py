"""``with BreakableCUDAGraphCapture(graph): ...``: capture a block on a side stream."""

from __future__ import annotations

import contextlib

import torch

from breakgraph import runtime
from breakgraph.dispatch import clearer_error
from breakgraph.options import CaptureOptions
from breakgraph.graph import BreakableCUDAGraph


class BreakableCUDAGraphCapture:
    """Context manager that captures its body into ``graph``.

    Graphable work becomes CUDA graph segments; ``@eager_on_graph`` functions
    and :func:`break_graph` end the current segment, run eagerly and are
    recorded for replay. Like ``torch.cuda.graph`` it captures on a side
    stream (``stream``, or one kept per thread) that first waits on the
    current stream's work; unlike it, it does not synchronize the device. The
    default stream is refused. ``capture_error_mode`` is CUDA's capture mode:
    "global", "thread_local" or "relaxed".

    ``random_ops="graph"`` (default): random ops are captured into the
    segments and draw fresh numbers at every replay, as under
    ``torch.cuda.graph``; the device's default generator is armed, and so are
    the CUDA ``torch.Generator``s in ``generators``. ``"break"``: every random
    op becomes an eager break, through an op watch that costs a Python call
    per op at capture (for torch versions whose generators cannot be armed).
    ``"error"``: random ops fail the capture, and no generator is armed.

    ``breaks="eager"`` (default) makes a breakable graph. ``breaks="inline"``
    makes one full graph: each ``@eager_on_graph`` function records its
    capturable variant (``inline=``) inside it, and a function without one
    fails the capture with an error that says to use the breakable mode.
    ``barrier_fn`` is called after a segment ends and before each break runs,
    and once when the capture ends: tensor-parallel ranks stay in step at
    every break during capture. ``measure_memory=True`` measures the device
    memory each segment's executable takes (``graph.executable_bytes``; about
    10 µs per segment, so off unless asked, here as in ``GraphRunner``).

    Any exception inside the block ends the CUDA capture, discards what was
    captured, restores the stream, pool routing and hooks, and propagates.
    """

    def __init__(
        self,
        graph: BreakableCUDAGraph,
        stream: torch.cuda.Stream | None = None,
        capture_error_mode: str = "global",
        random_ops: str = "graph",
        generators=(),
        breaks: str = "eager",
        barrier_fn=None,
        measure_memory: bool = False,
    ):
        if not isinstance(graph, BreakableCUDAGraph):
            raise TypeError(f"expected a BreakableCUDAGraph, got {type(graph).__name__}")
        self.graph = graph
        self.stream = stream
        self.options = CaptureOptions.parse(capture_error_mode, random_ops, generators, breaks, barrier_fn, measure_memory)
        self._scope: contextlib.ExitStack | None = None

    def __enter__(self) -> BreakableCUDAGraph:
        runtime.require_capture("a `with BreakableCUDAGraphCapture(...)` block")
        caller_stream = torch.cuda.current_stream(torch.cuda.current_device())
        with contextlib.ExitStack() as scope:
            # Held from before the stream is first touched: another capture's stream is refused.
            stream = scope.enter_context(runtime.claim_capture_stream(caller_stream.device, self.stream))
            # No host sync: the capture stream only has to follow the caller's work on the
            # GPU, so an engine's warm-up step can still run while its capture is recorded.
            stream.wait_stream(caller_stream)
            scope.enter_context(runtime.on_stream(stream))
            self.graph._begin(self.options, stream)
            self._caller_stream, self._capture_stream, self._scope = caller_stream, stream, scope.pop_all()
        return self.graph

    def __exit__(self, exc_type, exc, tb) -> bool:
        scope, self._scope = self._scope, None
        capture_stream = self._capture_stream
        try:
            if exc_type is None:
                self.graph.capture_end()
            else:
                self.graph.capture_abort()
        finally:
            scope.close()
        if exc_type is None:
            self._caller_stream.wait_stream(capture_stream)
            return False
        clearer = clearer_error(exc, self.options.random_ops)
        if clearer is not None:
            raise clearer from exc
        return False
