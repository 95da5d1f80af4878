"""Device memory as the driver sees it: what is free, and what graphs hold outside any allocator."""

from __future__ import annotations

from cuda.bindings import runtime as cudart

from .errors import check


def free_device_memory() -> int:
    """Bytes of the current device's memory that are free (``cudaMemGetInfo``): the one
    figure that also counts what the driver takes for instantiated executables."""
    free, _total = check(cudart.cudaMemGetInfo(), "cudaMemGetInfo")
    return int(free)


def graph_allocation_bytes(device: int) -> int:
    """Bytes the driver reserves on ``device`` for allocations made by graph memory nodes
    (``cudaGraphMemAttrReservedMemCurrent``); captures through torch's allocator make none."""
    attribute = cudart.cudaGraphMemAttributeType.cudaGraphMemAttrReservedMemCurrent
    return int(check(cudart.cudaDeviceGetGraphMemAttribute(device, attribute), "cudaDeviceGetGraphMemAttribute"))


def trim_graph_memory(device: int) -> None:
    """Give back what graph memory nodes reserve on ``device`` and no graph uses
    (``cudaDeviceGraphMemTrim``)."""
    check(cudart.cudaDeviceGraphMemTrim(device), "cudaDeviceGraphMemTrim")
