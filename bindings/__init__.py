"""Typed, error-checked calls into the CUDA runtime for stream capture and graphs.

A thin layer over ``cuda.bindings.runtime`` (cuda-python): every call checks its
status and raises :class:`CudaError` with the error's name and text. Streams may
be given as ``torch.cuda.Stream`` (anything with a ``cuda_stream`` attribute),
raw integer handles, or ``cudaStream_t``. Nothing here imports torch.

The folder is ``bindings/``; it installs as ``breakgraph_bindings``, a name no
other project uses, so no ``bindings`` package or folder elsewhere shadows it.
"""

from .errors import CudaError, check, clear_last_error
from .streams import HasCudaStream, StreamHandle, StreamLike, new_stream, stream_handle, synchronize
from .capture import (
    CaptureInfo,
    CaptureMode,
    CaptureStatus,
    begin_capture,
    capture_info,
    capture_status,
    discard_capture,
    end_capture,
    exchange_capture_mode,
)
from .events import Event, wait_event
from .graph import Graph, GraphExec, GraphLaunch, GraphUpdateRefused, LaunchStatus, device_count, launch_function, probe_devices
from .memory import free_device_memory, graph_allocation_bytes, trim_graph_memory
from .conditional import (
    ConditionalKind,
    ConditionalNode,
    add_conditional,
    begin_body_capture,
    end_body_capture,
    require_conditional_support,
    set_conditional,
)

__all__ = [
    "CaptureInfo",
    "CaptureMode",
    "CaptureStatus",
    "ConditionalKind",
    "ConditionalNode",
    "CudaError",
    "Event",
    "Graph",
    "GraphExec",
    "GraphLaunch",
    "GraphUpdateRefused",
    "HasCudaStream",
    "LaunchStatus",
    "StreamHandle",
    "StreamLike",
    "add_conditional",
    "begin_body_capture",
    "begin_capture",
    "capture_info",
    "capture_status",
    "check",
    "clear_last_error",
    "device_count",
    "discard_capture",
    "end_body_capture",
    "end_capture",
    "exchange_capture_mode",
    "free_device_memory",
    "graph_allocation_bytes",
    "launch_function",
    "new_stream",
    "probe_devices",
    "require_conditional_support",
    "set_conditional",
    "stream_handle",
    "synchronize",
    "trim_graph_memory",
    "wait_event",
]
