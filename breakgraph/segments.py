"""The pieces a breakable graph is made of: graph segments and eager breaks.

Graph segments come in two kinds: those breakgraph captured and launches
through cuda.bindings, and those that draw random numbers, which torch
captured and replays (:mod:`breakgraph.rng`). All kinds share one interface,
as ``torch.cuda.CUDAGraph.replay`` and an eager call share "run this step":
:meth:`launcher` returns the callable that runs the step on a stream handle,
:meth:`release` frees what the segment holds, and
``argument_addresses``/``result`` are what debug mode checks. Debug mode and
profiling are built on that interface alone; replay writes the steps out per
stream (:mod:`breakgraph.plan`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

import breakgraph_bindings as bindings
from breakgraph_bindings import Graph, GraphExec
from breakgraph.writeback import Writer

Launcher = Callable[[Any], Any]
"""``launch(stream_handle)``: returns ``(cudaError_t,)`` for a graph launch, None for eager work."""

_launch = bindings.launch_function()


def instantiate(graph: Graph, stream: bindings.StreamLike, measure: bool) -> tuple[GraphExec, int | None]:
    """Instantiate ``graph``. With ``measure``, also upload it on ``stream`` (the driver
    takes part of its memory there) and return the device memory the driver took for both,
    read with ``cudaMemGetInfo`` (exact only while no other thread allocates device
    memory); otherwise None, and its first launch uploads it (uploading at capture would
    cost every segment more than it saves the first launch)."""
    if not measure:
        return graph.instantiate(), None
    free_before = bindings.free_device_memory()
    executable = graph.instantiate()
    executable.upload(stream)
    return executable, max(0, free_before - bindings.free_device_memory())


class SharedExecutable:
    """One executable serving the same segment of several graphs (say, one per batch
    size): before launching for a graph whose parameters it does not hold, it takes
    them with ``cudaGraphExecUpdate``, which CUDA applies to later launches only."""

    def __init__(self, executable: GraphExec, holds: Graph):
        self.executable = executable
        self.holds = holds

    def take(self, graph: Graph) -> None:
        """Hold ``graph``'s parameters; raises ``GraphUpdateRefused`` (and then holds the
        parameters it held before) when CUDA cannot update one graph into the other."""
        try:
            self.executable.update(graph)
        except bindings.GraphUpdateRefused:
            self.executable.update(self.holds)
            raise
        self.holds = graph

    def launcher_for(self, graph: Graph) -> "Launcher":
        shared, handle = self, self.executable.handle

        def launch(stream):
            if shared.holds is not graph:
                shared.take(graph)
            return _launch(handle, stream)

        return launch


@dataclass(eq=False)
class GraphSegment:
    """A captured CUDA graph, launched as one unit at replay, through its own executable
    or one it shares with the same segment of other graphs (``shared``).
    ``executable_bytes`` is the device memory its own executable took (0 when shared,
    None when its capture did not measure)."""

    index: int
    name: str
    graph: Graph
    executable: GraphExec | None
    num_nodes: int
    side_streams: tuple[int, ...] = ()
    executable_bytes: int | None = None
    shared: SharedExecutable | None = field(default=None, init=False)
    kind: str = field(default="graph", init=False)
    draws_random_numbers: bool = field(default=False, init=False)
    argument_addresses: tuple = field(default=(), init=False)
    result: Any = field(default=None, init=False)
    bytes_written: int = field(default=0, init=False)

    def ready(self, stream: bindings.StreamLike, measure: bool) -> None:
        """Instantiate the captured graph (measuring its memory with ``measure``)."""
        self.executable, self.executable_bytes = instantiate(self.graph, stream, measure)

    def launcher(self) -> Launcher:
        if self.shared is not None:
            return self.shared.launcher_for(self.graph)
        if self.executable is None:
            raise RuntimeError(f"{self.name}: its executable was released; restore it first")
        # A C-level partial: replay pays one cudaGraphLaunch call per graph segment, nothing more.
        return functools.partial(_launch, self.executable.handle)

    def share(self, shared: SharedExecutable) -> None:
        """Launch through ``shared`` (which already holds this graph's parameters or can
        take them) and destroy this segment's own executable."""
        self.drop_executable()
        self.shared = shared

    def drop_executable(self) -> None:
        """Destroy this segment's own executable, or stop using a shared one; the graph stays."""
        if self.shared is None and self.executable is not None:
            self.executable.destroy()
        self.executable, self.shared = None, None
        if self.executable_bytes is not None:
            self.executable_bytes = 0

    def instantiate(self, stream: bindings.StreamLike) -> None:
        """Instantiate this segment's graph again (after :meth:`drop_executable`), measuring
        its memory if its capture did."""
        self.executable, self.executable_bytes = instantiate(self.graph, stream, measure=self.executable_bytes is not None)

    def release(self) -> None:
        self.drop_executable()
        self.graph.destroy()


def _replay_torch_graph(graph: "torch.cuda.CUDAGraph", _stream) -> None:
    graph.replay()


@dataclass(eq=False)
class TorchGraphSegment:
    """A segment that draws random numbers, captured by ``torch.cuda.CUDAGraph``, whose
    ``replay()`` refills and advances the generators before it launches on the current
    stream. ``graph`` is its ``cudaGraph_t``, borrowed to count and print. torch owns
    the executable: the segment keeps it when the others release theirs, and shares
    none (``executable`` stays None for :func:`~breakgraph.share_executables`)."""

    index: int
    name: str
    capture: "torch.cuda.CUDAGraph"
    graph: Graph
    num_nodes: int = 0
    side_streams: tuple[int, ...] = ()
    executable_bytes: int | None = None
    executable: None = field(default=None, init=False)
    shared: None = field(default=None, init=False)
    kind: str = field(default="graph", init=False)
    draws_random_numbers: bool = field(default=True, init=False)
    argument_addresses: tuple = field(default=(), init=False)
    result: Any = field(default=None, init=False)
    bytes_written: int = field(default=0, init=False)

    def ready(self, stream: bindings.StreamLike, measure: bool) -> None:
        """Instantiate through torch (measuring the memory it took with ``measure``)."""
        free_before = bindings.free_device_memory() if measure else 0
        self.capture.instantiate()
        self.executable_bytes = max(0, free_before - bindings.free_device_memory()) if measure else None

    def launcher(self) -> Launcher:
        return functools.partial(_replay_torch_graph, self.capture)

    def take_in(self, front: GraphSegment) -> bool:
        """Run ``front`` (the segment a random op ended just before this one began) at the start
        of this segment's launch, and release it: one launch where there were two. False, and
        nothing changed, where CUDA refuses ``front``'s graph as part of another."""
        try:
            self.graph.prepend(front.graph)
        except bindings.CudaError:
            return False
        self.name = f"{front.name.partition(' -> ')[0]} -> {self.name.partition(' -> ')[2]}"
        self.side_streams = tuple(dict.fromkeys(front.side_streams + self.side_streams))
        self.num_nodes += front.num_nodes
        front.release()
        return True

    def drop_executable(self) -> None:
        """Nothing: torch's executable stays (see the class)."""

    def instantiate(self, stream: bindings.StreamLike) -> None:
        """Nothing: the executable was kept."""

    def release(self) -> None:
        self.capture.reset()


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
    draws_random_numbers: bool = field(default=False, init=False)
    num_nodes: int = field(default=0, init=False)
    side_streams: tuple[int, ...] = field(default=(), init=False)
    executable_bytes: int = field(default=0, init=False)
    shared: None = field(default=None, init=False)

    def launcher(self) -> Launcher:
        segment, function, args, kwargs, write = self, self.function, self.args, self.kwargs, self.write

        def run(_stream) -> None:
            segment.bytes_written = write(function(*args, **kwargs))

        return run

    def release(self) -> None:
        self.args, self.kwargs, self.result = (), {}, None


Segment = GraphSegment | TorchGraphSegment | EagerSegment
