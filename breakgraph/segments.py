"""The pieces a breakable graph is made of: graph segments and eager breaks."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

from bindings import Graph, GraphExec
from breakgraph.writeback import Writer


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

    def release(self) -> None:
        self.executable.destroy()
        self.graph.destroy()


@dataclass(eq=False)
class EagerSegment:
    """An eager break: ``function`` replayed on aliases of its capture-time arguments.

    ``result`` is the capture-time result (aliases of its tensors when it is
    only tensors, see :func:`~breakgraph.aliasing.alias_result`); ``write``
    copies each replay's result into it, where later segments read it.
    ``argument_addresses`` (name, weak reference, data pointer) lets debug
    mode check that the caller's tensors did not move.
    """

    index: int
    name: str
    function: Callable
    args: tuple
    kwargs: dict
    result: Any
    write: Writer
    argument_addresses: tuple[tuple[str, weakref.ref, int], ...] = ()
    bytes_written: int = 0
    kind: str = field(default="eager", init=False)
    num_nodes: int = field(default=0, init=False)
    side_streams: tuple[int, ...] = field(default=(), init=False)

    def replay(self) -> None:
        self.bytes_written = self.write(self.function(*self.args, **self.kwargs))

    def replayer(self) -> Callable[[], None]:
        """:meth:`replay` with its lookups done once: replay's loop calls it for every break."""
        segment, function, args, kwargs, write = self, self.function, self.args, self.kwargs, self.write

        def replay() -> None:
            segment.bytes_written = write(function(*args, **kwargs))

        return replay

    def release(self) -> None:
        self.args, self.kwargs, self.result = (), {}, None
