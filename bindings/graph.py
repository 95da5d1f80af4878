"""CUDA graphs and executable graphs, each handle destroyed exactly once."""

from __future__ import annotations

import os
from typing import Callable

import cuda.bindings
from cuda.bindings import runtime as cudart

from .errors import CudaError, check, clear_last_error
from .streams import StreamHandle, StreamLike, stream_handle

_SUCCESS = cudart.cudaError_t.cudaSuccess
_EDGES_TAKE_DATA = int(cuda.bindings.__version__.split(".")[0]) >= 13  # CUDA 13 added edge data to the call


LaunchStatus = tuple[cudart.cudaError_t]
"""What a raw ``cudaGraphLaunch`` returns: its status alone, checked by the caller."""

GraphLaunch = Callable[[cudart.cudaGraphExec_t, StreamHandle], LaunchStatus]
"""The raw ``cudaGraphLaunch(executable, stream)`` (:func:`launch_function`)."""


def _add_dependencies(
    graph: cudart.cudaGraph_t, sources: list[cudart.cudaGraphNode_t], targets: list[cudart.cudaGraphNode_t]
) -> tuple[cudart.cudaError_t]:
    """``cudaGraphAddDependencies`` as this cuda-bindings release spells it."""
    if _EDGES_TAKE_DATA:
        return cudart.cudaGraphAddDependencies(graph, sources, targets, None, len(sources))
    return cudart.cudaGraphAddDependencies(graph, sources, targets, len(sources))


class _Owned:
    """A handle destroyed exactly once: by :meth:`destroy`, or when the object dies.

    ``__del__`` rather than ``weakref.finalize``: a capture makes two of these per
    segment, and a finalizer costs several microseconds to register. One that
    is still alive at interpreter exit may be left to the process's end, which
    frees it with the CUDA context. A handle has one owner: it is not copied.
    :class:`Graph` sets these fields itself, without ``super()``: a field added here goes there too.
    """

    __slots__ = ("handle", "_owned", "__weakref__")
    _destroy: Callable  # the raw cudaGraphDestroy or cudaGraphExecDestroy

    def __init__(self, handle, owned: bool = True) -> None:
        self.handle = handle
        self._owned = owned

    def destroy(self) -> None:
        """Destroy now rather than when the object dies; later calls do nothing."""
        if self._owned:
            self._owned = False
            type(self)._destroy(self.handle)

    def __del__(self) -> None:
        try:
            self.destroy()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    def __reduce__(self):
        raise TypeError(f"a {type(self).__name__} owns its CUDA handle: it cannot be copied or pickled")

    @property
    def alive(self) -> bool:
        """Whether the handle has not been destroyed."""
        return self._owned


class Graph(_Owned):
    """An owned ``cudaGraph_t`` (what a capture produced)."""

    __slots__ = ("_borrowed",)
    _destroy = staticmethod(cudart.cudaGraphDestroy)

    def __init__(self, handle: cudart.cudaGraph_t, owned: bool = True):
        # _Owned's fields set here rather than through super(): a capture makes one a break.
        self.handle, self._owned, self._borrowed = handle, owned, not owned

    @classmethod
    def borrowed(cls, handle: int) -> "Graph":
        """A ``cudaGraph_t`` another owner destroys (torch's ``CUDAGraph``): counted, printed
        and instantiated here, never destroyed."""
        return cls(cudart.cudaGraph_t(init_value=int(handle)), owned=False)

    @property
    def num_nodes(self) -> int:
        """Number of nodes in the graph (``cudaGraphGetNodes``)."""
        _nodes, count = check(cudart.cudaGraphGetNodes(self.handle, 0), "cudaGraphGetNodes")
        return int(count)

    def root_nodes(self) -> list:
        """The nodes that depend on no other (``cudaGraphGetRootNodes``)."""
        _nodes, count = check(cudart.cudaGraphGetRootNodes(self.handle, 0), "cudaGraphGetRootNodes")
        nodes, _count = check(cudart.cudaGraphGetRootNodes(self.handle, count), "cudaGraphGetRootNodes")
        return list(nodes or ())

    def prepend(self, front: "Graph") -> None:
        """Make one launch of this graph run ``front``'s work first: a copy of ``front`` becomes
        a child-graph node that every root node of this graph depends on
        (``cudaGraphAddChildGraphNode``). Where CUDA refuses ``front`` as a child graph (one
        with memory allocation, free or conditional nodes), raises :class:`CudaError` and
        leaves this graph as it was."""
        roots = self.root_nodes()
        node = check(cudart.cudaGraphAddChildGraphNode(self.handle, None, 0, front.handle), "cudaGraphAddChildGraphNode")
        if not roots:
            return
        try:
            check(_add_dependencies(self.handle, [node] * len(roots), roots), "cudaGraphAddDependencies")
        except CudaError:
            cudart.cudaGraphDestroyNode(node)
            raise

    def instantiate(self, flags: int = 0) -> "GraphExec":
        """Create an executable graph (``cudaGraphInstantiate``)."""
        return GraphExec(check(cudart.cudaGraphInstantiate(self.handle, flags), "cudaGraphInstantiate"))

    def to_dot(self, path: str | os.PathLike, verbose: bool = False) -> None:
        """Write the graph as a Graphviz DOT file (``cudaGraphDebugDotPrint``)."""
        flags = cudart.cudaGraphDebugDotFlags.cudaGraphDebugDotFlagsVerbose if verbose else 0
        check(cudart.cudaGraphDebugDotPrint(self.handle, os.fsencode(path), int(flags)), "cudaGraphDebugDotPrint")

    @property
    def alive(self) -> bool:
        """Whether the handle is still valid: owned and not destroyed, or borrowed."""
        return self._owned or self._borrowed


class GraphUpdateRefused(CudaError):
    """``cudaGraphExecUpdate`` refused a graph; ``reason`` is CUDA's update result
    (``ErrorTopologyChanged``, ...) where the binding reports it, else the error's name."""

    def __init__(self, code, function: str, detail: str, reason: str):
        super().__init__(code, function, detail)
        self.reason = reason


class GraphExec(_Owned):
    """An owned ``cudaGraphExec_t``."""

    __slots__ = ()
    _destroy = staticmethod(cudart.cudaGraphExecDestroy)

    def launch(self, stream: StreamLike) -> None:
        """Launch on ``stream`` (``cudaGraphLaunch``)."""
        check(cudart.cudaGraphLaunch(self.handle, stream_handle(stream)), "cudaGraphLaunch")

    def upload(self, stream: StreamLike) -> None:
        """Upload to the device ahead of the first launch (``cudaGraphUpload``)."""
        check(cudart.cudaGraphUpload(self.handle, stream_handle(stream)), "cudaGraphUpload")

    def update(self, graph: Graph) -> None:
        """Take ``graph``'s node parameters, kernels included, in place
        (``cudaGraphExecUpdate``): the next launch runs ``graph``'s work. Raises
        :class:`GraphUpdateRefused` when the two graphs differ in a way CUDA cannot
        update (topology, node types, ...); what the executable holds after a refusal
        is not promised, so update it again with the graph it should hold."""
        err, info = cudart.cudaGraphExecUpdate(self.handle, graph.handle)
        if err != _SUCCESS:  # cuda-bindings returns no result info with an error
            clear_last_error()  # the caller handles the refusal: torch's next check must not see it
            reason = info.result.name.removeprefix("cudaGraphExecUpdate") if info is not None else CudaError(err).name
            raise GraphUpdateRefused(err, "cudaGraphExecUpdate", "", reason)


def launch_function() -> GraphLaunch:
    """The raw ``cudaGraphLaunch(exec_handle, stream_handle) -> (err,)``.

    For replay loops that pre-bind handles and check ``err`` themselves: it
    skips the per-call conversions of :meth:`GraphExec.launch`.
    """
    return cudart.cudaGraphLaunch


def probe_devices() -> int:
    """Number of CUDA devices the runtime sees (``cudaGetDeviceCount``); raises
    :class:`CudaError` when it cannot talk to the driver (none, or too old for this
    cuda-bindings release)."""
    return int(check(cudart.cudaGetDeviceCount(), "cudaGetDeviceCount"))


def device_count() -> int:
    """Number of CUDA devices; 0 where there is no driver or no device."""
    try:
        return probe_devices()
    except Exception:
        return 0
