"""The pieces a breakable graph is made of, one class per kind, and the graph segments.

Every kind implements :class:`Segment` (the eager break's is
:class:`breakgraph.recording.breaks.EagerSegment`), and no other module tells kinds apart
(``kind`` is only shown). A segment writes the lines of its own replay into the
replay's source (:meth:`~Segment.emit`): those lines are the one place a kind's
replay is written, and :mod:`breakgraph.graphs.plan` builds from them both the replay
function and the per-step functions that debug mode checks and the profile
times. The rest of the interface ends a capture (:meth:`~Segment.captured_anything`,
:meth:`~Segment.take_in`, :meth:`~Segment.ready`), releases and restores
executables (:meth:`~Segment.drop_executable`, :meth:`~Segment.instantiate`),
frees what a segment holds (:meth:`~Segment.release`), and says what it is
(:meth:`~Segment.describe`, :meth:`~Segment.table_cells`, :meth:`~Segment.dot_node`).
"""

from __future__ import annotations

import abc
import functools
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Protocol

import torch

import breakgraph_bindings as bindings
from breakgraph_bindings import Graph, GraphExec, LaunchStatus, StreamHandle, StreamLike

_launch = bindings.launch_function()


class ReplaySource(Protocol):
    """The source a segment writes its replay into: a function's body, and the names it binds."""

    stream: StreamHandle  # the stream the lines launch on

    def bind(self, name: str, value: Any) -> str:
        """Bind ``value`` in the function's namespace under ``name`` made unique to this segment;
        return the name the lines use."""

    def launch(self, *lines: str) -> None:
        """Lines that only launch work: autograd stays as the caller has it."""

    def python(self, *lines: str) -> None:
        """Lines that run Python (a break): autograd goes off before the first of them."""


def raise_launch_failure(description: str, error: int) -> None:
    """Raise the failed launch of the segment ``description`` names, and clear CUDA's last error."""
    bindings.clear_last_error()
    raise bindings.CudaError(error, "cudaGraphLaunch", description)


def instantiate(graph: Graph, stream: StreamLike, measure: bool) -> tuple[GraphExec, int | None]:
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

    def launch_for(self, graph: Graph, stream: StreamHandle) -> Callable[[], LaunchStatus]:
        """Launch on ``stream`` with ``graph``'s parameters, taking them first if needed."""
        shared, handle = self, self.executable.handle

        def launch() -> LaunchStatus:
            if shared.holds is not graph:
                shared.take(graph)
            return _launch(handle, stream)

        return launch


@dataclass(eq=False)
class Segment(abc.ABC):
    """One step of a replay, in capture order. The fields every kind has: what the
    tables, ``graph.executable_bytes`` and debug mode read, with the values of a kind
    that has none of it (no nodes, no executable, nothing written back)."""

    kind: ClassVar[str]  # shown in tables and errors: "graph", "eager"
    draws_random_numbers: ClassVar[bool] = False

    index: int
    name: str
    _: KW_ONLY
    num_nodes: int = 0
    side_streams: tuple[int, ...] = ()
    executable_bytes: int | None = 0  # None: its capture did not measure it
    argument_addresses: tuple[tuple, ...] = ()  # debug mode checks them before each replay
    result: Any = None  # debug mode checks it for NaN and Inf
    bytes_written: int = field(default=0, init=False)
    shared: SharedExecutable | None = field(default=None, init=False)

    @abc.abstractmethod
    def emit(self, source: ReplaySource) -> None:
        """Write this segment's replay into ``source``."""

    def describe(self) -> str:
        """How errors name it."""
        return f"segment {self.index} ({self.kind}: {self.name})"

    def table_cells(self) -> dict[str, Any]:
        """Its cells of the segment table that only some kinds fill."""
        return {"nodes": self.num_nodes, "bytes_written": self.bytes_written}

    def dot_node(self) -> str:
        """Its node's attributes in the DOT overview."""
        label = f"{self.kind} {self.index}\\n{self.name}".replace('"', "'")
        return f'shape=ellipse, label="{label}"'

    def write_dot(self, path: Path) -> bool:
        """Write its own DOT file to ``path``; False where it has none."""
        return False

    def captured_anything(self) -> bool:
        """At the capture's end: whether it recorded any work (one that did not is dropped)."""
        return True

    def take_in(self, front: Segment) -> bool:
        """Run ``front``, the segment just before it, as part of its own launch and release it;
        False, and nothing changed, where it cannot."""
        return False

    def ready(self, stream: StreamLike, measure: bool) -> None:
        """Make it launchable once the capture has ended (measuring the memory that takes)."""

    @property
    def has_own_executable(self) -> bool:
        """Whether it holds an executable that other graphs' same segment could launch too."""
        return False

    def drop_executable(self) -> None:
        """Let its executable go, keeping what is needed to instantiate it again."""

    def instantiate(self, stream: StreamLike) -> None:
        """Instantiate again what :meth:`drop_executable` let go."""

    def release(self) -> None:
        """Free everything it holds: the graph is reset."""


@dataclass(eq=False)
class _CapturedGraph(Segment):
    """What the kinds that replay a captured CUDA graph share: ``graph``, to count and print."""

    kind: ClassVar[str] = "graph"

    graph: Graph

    def table_cells(self) -> dict[str, Any]:
        return {"nodes": self.num_nodes, "bytes_written": ""}

    def dot_node(self) -> str:
        return f'shape=box, label="graph {self.index}\\n{self.num_nodes} nodes"'

    def write_dot(self, path: Path) -> bool:
        self.graph.to_dot(path)
        return True

    def captured_anything(self) -> bool:
        """Counts the graph's nodes: at the capture's end, as CUDA counts graphs back to back
        faster than one at each break (docs/performance.md)."""
        self.num_nodes = self.graph.num_nodes
        return self.num_nodes > 0


@dataclass(eq=False)
class GraphSegment(_CapturedGraph):
    """A captured CUDA graph, launched as one unit at replay, through its own executable
    or one it shares with the same segment of other graphs (``shared``).
    ``executable_bytes`` is the device memory its own executable took (0 when shared,
    None when its capture did not measure)."""

    executable: GraphExec | None
    conditional_nodes: int = 0  # its executable is its own: an update cannot take another graph's

    def emit(self, source: ReplaySource) -> None:
        launch = source.bind("launch", self.launch_on(source.stream))
        failed = source.bind("launch_failed", functools.partial(raise_launch_failure, self.describe()))
        source.launch(f"status = {launch}()", "if status[0]:", f"    {failed}(status[0])")

    def launch_on(self, stream: StreamHandle) -> Callable[[], LaunchStatus]:
        """The call that launches it on ``stream``: with its own executable a C-level partial,
        so replay pays one ``cudaGraphLaunch`` per graph segment, nothing more."""
        if self.shared is not None:
            return self.shared.launch_for(self.graph, stream)
        if self.executable is None:
            raise RuntimeError(f"{self.name}: its executable was released; restore it first")
        return functools.partial(_launch, self.executable.handle, stream)

    def ready(self, stream: StreamLike, measure: bool) -> None:
        self.executable, self.executable_bytes = instantiate(self.graph, stream, measure)

    @property
    def has_own_executable(self) -> bool:
        return self.executable is not None

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

    def instantiate(self, stream: StreamLike) -> None:
        """Instantiate its graph again, measuring its memory if its capture did."""
        self.executable, self.executable_bytes = instantiate(self.graph, stream, measure=self.executable_bytes is not None)

    def release(self) -> None:
        self.drop_executable()
        self.graph.destroy()


@dataclass(eq=False)
class TorchGraphSegment(_CapturedGraph):
    """A segment that draws random numbers, captured by ``torch.cuda.CUDAGraph``, whose
    ``replay()`` refills and advances the generators before it launches on the current
    stream. ``graph`` is its ``cudaGraph_t``, borrowed to count and print. torch owns
    the executable: the segment keeps it when the others release theirs, and shares
    none (``executable`` stays None for :func:`~breakgraph.share_executables`)."""

    draws_random_numbers: ClassVar[bool] = True

    capture: torch.cuda.CUDAGraph
    executable: None = field(default=None, init=False)

    def emit(self, source: ReplaySource) -> None:
        # torch launches on the current stream, the one the replay runs on
        source.launch(f"{source.bind('replay', self.capture.replay)}()")

    def ready(self, stream: StreamLike, measure: bool) -> None:
        """Instantiate through torch (measuring the memory it took with ``measure``)."""
        free_before = bindings.free_device_memory() if measure else 0
        self.capture.instantiate()
        self.executable_bytes = max(0, free_before - bindings.free_device_memory()) if measure else None

    def take_in(self, front: Segment) -> bool:
        """Takes in a segment captured through cuda.bindings (one launch where there were
        two), where CUDA accepts its graph as part of another: not one with conditional nodes,
        whose handles belong to their own graph."""
        if not isinstance(front, GraphSegment) or front.conditional_nodes:
            return False
        try:
            self.graph.prepend(front.graph)
        except bindings.CudaError:
            return False
        self.name = f"{front.name.partition(' -> ')[0]} -> {self.name.partition(' -> ')[2]}"
        self.side_streams = tuple(dict.fromkeys(front.side_streams + self.side_streams))
        self.num_nodes += front.num_nodes
        front.release()
        return True

    def release(self) -> None:
        self.capture.reset()
