"""Conditional nodes: a branch or a loop that the graph decides on the device.

A conditional node runs a body graph when its handle is set (IF), one of two
(IF_ELSE: the first when set, the second when not), or its body again and
again while the handle stays set (WHILE). A one-thread kernel sets the handle
from a byte in device memory (``cudaGraphSetConditional``); it is compiled once
per process and device with NVRTC, to a cubin for the device's architecture,
so no compiler, headers or device runtime library are needed.

:func:`add_conditional` splices a node into the capture under way on a stream;
each body is then captured on a stream of its own with
:func:`begin_body_capture` / :func:`end_body_capture`. A body may hold kernels,
memsets, memcopies and other conditional nodes only (CUDA's rule): no events,
host functions or stream-ordered allocations.
"""

from __future__ import annotations

import ctypes
import enum
from dataclasses import dataclass

from cuda.bindings import driver, nvrtc
from cuda.bindings import runtime as cudart

from .capture import CaptureMode, CaptureStatus, exchange_capture_mode
from .errors import check, check_driver, values_of
from .graph import _EDGES_TAKE_DATA, Graph
from .streams import StreamLike, stream_handle

_SETTER_SOURCE = r"""
extern "C" __device__ __cudart_builtin__ void CUDARTAPI cudaGraphSetConditional(cudaGraphConditionalHandle handle, unsigned int value);

extern "C" __global__ void breakgraph_set_conditional(cudaGraphConditionalHandle handle, const unsigned char* flag)
{
    cudaGraphSetConditional(handle, *flag ? 1u : 0u);
}
"""
_SETTER_NAME = b"breakgraph_set_conditional"


class ConditionalKind(enum.Enum):
    """What a conditional node does with its body graphs, and the CUDA release (as
    ``cudaDriverGetVersion`` reports it) whose driver it needs."""

    IF = (cudart.cudaGraphConditionalNodeType.cudaGraphCondTypeIf, 1, 12030)
    IF_ELSE = (cudart.cudaGraphConditionalNodeType.cudaGraphCondTypeIf, 2, 12080)
    WHILE = (cudart.cudaGraphConditionalNodeType.cudaGraphCondTypeWhile, 1, 12030)

    @property
    def needs_driver(self) -> int:
        return self.value[2]


def driver_version() -> int:
    """The CUDA release the driver supports, as 1000 * major + 10 * minor (``cudaDriverGetVersion``)."""
    return int(check(cudart.cudaDriverGetVersion(), "cudaDriverGetVersion"))


def _release(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"


def require_conditional_support(kind: ConditionalKind, what: str) -> None:
    """Refuse ``kind`` where the driver predates it, naming the CUDA release it needs."""
    have = driver_version()
    if have < kind.needs_driver:
        raise RuntimeError(
            f"{what} needs a driver for CUDA {_release(kind.needs_driver)} or later (conditional nodes); this "
            f"driver supports CUDA {_release(have)}. Update the NVIDIA driver, or run it outside the capture "
            "(as an eager break)."
        )


@dataclass(frozen=True)
class ConditionalNode:
    """A conditional node added to a capture: the handle its setter kernel sets and its
    body graphs, which the node owns (never destroy them)."""

    kind: ConditionalKind
    handle: int
    bodies: tuple[Graph, ...]


def add_conditional(stream: StreamLike, kind: ConditionalKind, flag: int) -> ConditionalNode:
    """Add a ``kind`` node to the graph ``stream`` is capturing into, after the work
    captured so far, with a handle set from the byte at device address ``flag`` just
    before it; the stream's later work follows the node."""
    handle = stream_handle(stream)
    graph = _capturing_graph(handle)
    setter = _current_setter()  # first: a handle no node takes would fail the graph's instantiation
    condition = check(cudart.cudaGraphConditionalHandleCreate(graph, 0, 0), "cudaGraphConditionalHandleCreate")
    _launch(setter, handle, int(condition), flag)
    status, _id, graph, dependencies, edges, count = _capture_info(handle)
    params = cudart.cudaGraphNodeParams()
    params.type = cudart.cudaGraphNodeType.cudaGraphNodeTypeConditional
    params.conditional.handle = condition
    params.conditional.type, params.conditional.size, _ = kind.value
    if _EDGES_TAKE_DATA:
        node = check(cudart.cudaGraphAddNode(graph, dependencies, edges, count, params), "cudaGraphAddNode")
        update = cudart.cudaStreamUpdateCaptureDependencies(handle, [node], None, 1, _SET_DEPENDENCIES)
    else:
        node = check(cudart.cudaGraphAddNode(graph, dependencies, count, params), "cudaGraphAddNode")
        update = cudart.cudaStreamUpdateCaptureDependencies(handle, [node], 1, _SET_DEPENDENCIES)
    check(update, "cudaStreamUpdateCaptureDependencies")
    bodies = tuple(Graph.borrowed(int(body)) for body in params.conditional.phGraph_out)
    return ConditionalNode(kind, int(condition), bodies)


_SET_DEPENDENCIES = cudart.cudaStreamUpdateCaptureDependenciesFlags.cudaStreamSetCaptureDependencies


def _capture_info(stream: cudart.cudaStream_t) -> tuple:
    """``(status, id, graph, dependencies, edge data, count)``; edge data is None before CUDA 13."""
    values = check(cudart.cudaStreamGetCaptureInfo(stream), "cudaStreamGetCaptureInfo")
    if not _EDGES_TAKE_DATA:
        status, capture_id, graph, dependencies, count = values
        return status, capture_id, graph, dependencies, None, count
    return values


def _capturing_graph(stream: cudart.cudaStream_t) -> cudart.cudaGraph_t:
    status, _id, graph, *_ = _capture_info(stream)
    if CaptureStatus(status) is not CaptureStatus.ACTIVE:
        raise RuntimeError("a conditional node goes into a capture under way, and this stream is not capturing")
    return graph


def begin_body_capture(stream: StreamLike, body: Graph, mode: CaptureMode | str) -> None:
    """Capture ``stream``'s work into ``body``, a conditional node's body graph
    (``cudaStreamBeginCaptureToGraph``); ``stream`` must not be capturing already."""
    check(
        cudart.cudaStreamBeginCaptureToGraph(stream_handle(stream), body.handle, None, None, 0, CaptureMode.parse(mode).value),
        "cudaStreamBeginCaptureToGraph",
    )


def end_body_capture(stream: StreamLike) -> None:
    """End the body capture on ``stream``; its graph stays the node's. An invalidated
    capture raises :class:`CudaError` (``cudaErrorStreamCaptureInvalidated``)."""
    check(cudart.cudaStreamEndCapture(stream_handle(stream)), "cudaStreamEndCapture")


def set_conditional(stream: StreamLike, handle: int, flag: int) -> None:
    """Launch the kernel that sets ``handle`` from the byte at device address ``flag``
    on ``stream`` (in a capture: a kernel node; in a WHILE body, its last one)."""
    _launch(_current_setter(), stream_handle(stream), handle, flag)


def _launch(setter: driver.CUfunction, stream: cudart.cudaStream_t, handle: int, flag: int) -> None:
    arguments = ((handle, flag), (ctypes.c_ulonglong, ctypes.c_void_p))
    raw = driver.CUstream(int(stream))
    check_driver(driver.cuLaunchKernel(setter, 1, 1, 1, 1, 1, 1, 0, raw, arguments, 0), "cuLaunchKernel")


def _current_setter() -> driver.CUfunction:
    return _setter(int(check(cudart.cudaGetDevice(), "cudaGetDevice")))


_setters: dict[int, driver.CUfunction] = {}


def _setter(device: int) -> driver.CUfunction:
    """The setter kernel, loaded into ``device``'s current context; compiled and loaded on
    first use, with the thread's capture mode relaxed (loading a module is a call a
    capture in global mode refuses)."""
    setter = _setters.get(device)
    if setter is None:
        cubin = _compile_setter(device)
        previous = exchange_capture_mode(CaptureMode.RELAXED)
        try:
            module = check_driver(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
            setter = check_driver(driver.cuModuleGetFunction(module, _SETTER_NAME), "cuModuleGetFunction")
        finally:
            exchange_capture_mode(previous)
        _setters[device] = setter
    return setter


def _compile_setter(device: int) -> bytes:
    """The setter as a cubin for ``device``'s architecture (NVRTC; a cubin rather than PTX,
    which a driver older than NVRTC could not load)."""
    major = check(cudart.cudaDeviceGetAttribute(cudart.cudaDeviceAttr.cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute")
    minor = check(cudart.cudaDeviceGetAttribute(cudart.cudaDeviceAttr.cudaDevAttrComputeCapabilityMinor, device), "cudaDeviceGetAttribute")
    supported = _nvrtc(nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs")
    if major * 10 + minor not in supported:
        raise RuntimeError(
            f"this NVRTC cannot compile for the GPU's architecture sm_{major}{minor} (it knows sm_{min(supported)} to "
            f"sm_{max(supported)}); install the nvidia-cuda-nvrtc release of torch's CUDA version, or a newer one"
        )
    options = [f"--gpu-architecture=sm_{major}{minor}".encode(), b"-std=c++17"]
    program = _nvrtc(nvrtc.nvrtcCreateProgram(_SETTER_SOURCE.encode(), b"breakgraph_conditional.cu", 0, [], []), "nvrtcCreateProgram")
    try:
        (compiled,) = nvrtc.nvrtcCompileProgram(program, len(options), options)
        if compiled != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            size = _nvrtc(nvrtc.nvrtcGetProgramLogSize(program), "nvrtcGetProgramLogSize")
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(program, log)
            raise RuntimeError(
                f"NVRTC could not compile the kernel that sets a conditional node's handle for sm_{major}{minor}: "
                f"{log.decode(errors='replace').strip()}. Conditional nodes need NVRTC from CUDA 12.3 or later "
                "(the nvidia-cuda-nvrtc release of torch's CUDA version)."
            )
        size = _nvrtc(nvrtc.nvrtcGetCUBINSize(program), "nvrtcGetCUBINSize")
        cubin = b" " * size
        _nvrtc(nvrtc.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(program)


def _nvrtc(result, call: str):
    err = result[0]
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"{call}: {err.name}")
    return values_of(result)
