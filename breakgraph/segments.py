"""The pieces a breakable graph is made of: graph segments and eager breaks.

Both kinds share one interface, as ``torch.cuda.CUDAGraph.replay`` and an
eager call share "run this step": :meth:`launcher` returns the callable that
replay's loop calls with the stream handle, :meth:`release` frees what the
segment holds, and ``argument_addresses``/``result`` are what debug mode
checks. Replay, debug mode and profiling are built on that interface alone.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import breakgraph_bindings as bindings
from breakgraph_bindings import Graph, GraphExec
from breakgraph.writeback import Writer

Launcher = Callable[[Any], Any]
"""``launch(stream_handle)``: returns ``(cudaError_t,)`` for a graph launch, None for eager work."""

_launch = bindings.launch_function()


@dataclass(eq=False)
class GraphSegment:
    """A captured CUDA graph, launched as one unit at replay."""

    index: int
    name: str
    graph: Graph
    executable: GraphExec
    num_nodes: int
    side_streams: tuple[int, ...] = ()
    kind: str = field(default="graph", init=False)
    argument_addresses: tuple = field(default=(), init=False)
    result: Any = field(default=None, init=False)
    bytes_written: int = field(default=0, init=False)

    def launcher(self) -> Launcher:
        # A C-level partial: replay pays one cudaGraphLaunch call per graph segment, nothing more.
        return functools.partial(_launch, self.executable.handle)

    def release(self) -> None:
        self.executable.destroy()
        self.graph.destroy()


@dataclass(eq=False)
class EagerSegment:
    """An eager break: ``function`` replayed on aliases of its capture-time arguments.

    ``result`` is the capture-time result (aliases of its tensors when it is
    only CUDA tensors, see :func:`~breakgraph.aliasing.alias_result`); ``write``
    copies each replay's result into it, where later segments read it.
    ``argument_addresses`` (path, weak references to the tensor and its
    storage, data pointer, whether the graph's pool holds it) lets debug mode
    check that the caller's tensors did not move or die.
    """

    index: int
    name: str
    function: Callable
    args: tuple
    kwargs: dict
    result: Any
    write: Writer
    argument_addresses: tuple[tuple, ...] = ()
    bytes_written: int = 0
    kind: str = field(default="eager", init=False)
    num_nodes: int = field(default=0, init=False)
    side_streams: tuple[int, ...] = field(default=(), init=False)

    def launcher(self) -> Launcher:
        segment, function, args, kwargs, write = self, self.function, self.args, self.kwargs, self.write

        def run(_stream) -> None:
            segment.bytes_written = write(function(*args, **kwargs))

        return run

    def release(self) -> None:
        self.args, self.kwargs, self.result = (), {}, None


Segment = GraphSegment | EagerSegment
