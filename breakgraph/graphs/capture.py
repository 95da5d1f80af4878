"""``with BreakableCUDAGraphCapture(graph): ...``: capture a block on a side stream."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from breakgraph.base import runtime
from breakgraph.recording.dispatch import clearer_error
from breakgraph.base.options import CaptureOptions
from breakgraph.graphs.graph import BreakableCUDAGraph


class BreakableCUDAGraphCapture:
    """Context manager that captures its body into ``graph``.

    Graphable work becomes CUDA graph segments; ``@eager_on_graph`` functions
    and :func:`break_graph` end the current segment, run eagerly and are
    recorded for replay. Like ``torch.cuda.graph`` it captures on a side
    stream that first waits on the current stream's work; unlike it, it does
    not synchronize the device.

    Any exception inside the block ends the CUDA capture, discards what was
    captured, restores the stream, pool routing and hooks, and propagates.

    Arguments:
        graph (BreakableCUDAGraph): the graph to capture into.
        stream (torch.cuda.Stream or torch.Stream, optional): the capture stream, a
            ``torch.cuda.Stream`` or a GPU's generic ``torch.Stream``. Default: a
            stream of breakgraph's own, outside torch's pool. The default stream is refused.
        options (CaptureOptions, optional): how the capture treats random ops,
            breaks and barriers. Default: ``CaptureOptions()``.
        **capture_options: any field of :class:`~breakgraph.CaptureOptions` by
            name (``capture_error_mode``, ``random_ops``, ``generators``,
            ``breaks``, ``barrier_fn``, ``measure_memory``), set on top of
            ``options``.

    .. warning::
        A device-wide ``torch.cuda.synchronize()`` in any thread while this
        block captures invalidates the capture (CUDA's rule), and under
        ``capture_error_mode="global"`` so does any thread's stream
        synchronize: the block raises :class:`~breakgraph.CaptureInvalidatedError`.
    """

    def __init__(
        self,
        graph: BreakableCUDAGraph,
        stream: torch.cuda.Stream | torch.Stream | None = None,
        *,
        options: CaptureOptions | None = None,
        **capture_options: Any,
    ):
        if not isinstance(graph, BreakableCUDAGraph):
            raise TypeError(f"expected a BreakableCUDAGraph, got {type(graph).__name__}")
        stream = runtime.as_cuda_stream(stream)
        if stream is not None and not isinstance(stream, torch.cuda.Stream):
            raise TypeError(f"stream must be a torch.cuda.Stream, a GPU's torch.Stream, or None; got {type(stream).__name__} {stream!r}")
        self.graph = graph
        self.stream = stream
        self.options = CaptureOptions.build("BreakableCUDAGraphCapture", options, capture_options)
        self._scope: contextlib.ExitStack | None = None

    def __enter__(self) -> BreakableCUDAGraph:
        runtime.require_capture("a `with BreakableCUDAGraphCapture(...)` block")
        # The stream the caller's work is on, on the device that captures: ``stream``'s, if given.
        caller_stream = torch.cuda.current_stream(torch.cuda.current_device() if self.stream is None else self.stream.device)
        with contextlib.ExitStack() as scope:
            # Held from before the stream is first touched: another capture's stream is refused.
            stream = scope.enter_context(runtime.claim_capture_stream(caller_stream.device, self.stream))
            # No host sync: the capture stream only has to follow the caller's work on the
            # GPU, so an engine's warm-up step can still run while its capture is recorded.
            stream.wait_stream(caller_stream)
            scope.enter_context(runtime.on_stream(stream))
            self.graph.capture_begin(options=self.options)  # on the capture stream, current now
            self._caller_stream, self._capture_stream, self._scope = caller_stream, stream, scope.pop_all()
        return self.graph

    def __exit__(self, exc_type, exc, tb) -> bool:
        scope, self._scope = self._scope, None
        ended = False
        try:
            if exc_type is None:
                self.graph.capture_end()
                ended = True
            else:
                self.graph.capture_abort()
        finally:
            try:
                # The caller's later work follows what the capture stream ran, a failed capture's
                # eager breaks too; after a failure only where CUDA still can: its error is the one
                # to report. Before the stream is released: another capture may take it then.
                with contextlib.nullcontext() if ended else contextlib.suppress(RuntimeError):
                    self._caller_stream.wait_stream(self._capture_stream)
            finally:
                scope.close()
        clearer = None if exc_type is None else clearer_error(exc, self.options.random_ops)
        if clearer is not None:
            raise clearer from exc
        return False
