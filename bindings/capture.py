"""Stream capture: begin, end, and what a stream is capturing."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from cuda.bindings import runtime as cudart

from .errors import CudaError, check
from .graph import Graph
from .streams import StreamLike, stream_handle


class CaptureMode(enum.Enum):
    """CUDA's stream-capture interaction modes (``cudaStreamCaptureMode``)."""

    GLOBAL = cudart.cudaStreamCaptureMode.cudaStreamCaptureModeGlobal
    THREAD_LOCAL = cudart.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal
    RELAXED = cudart.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed

    @classmethod
    def parse(cls, mode: "CaptureMode | str") -> "CaptureMode":
        """Accept a member or its name as torch spells it: "global", "thread_local", "relaxed"."""
        if isinstance(mode, cls):
            return mode
        try:
            return cls[str(mode).upper()]
        except KeyError:
            raise ValueError(
                f"capture_error_mode must be 'global', 'thread_local' or 'relaxed', got {mode!r}"
            ) from None


class CaptureStatus(enum.Enum):
    """``cudaStreamCaptureStatus``: not capturing, capturing, or invalidated by an error."""

    NONE = cudart.cudaStreamCaptureStatus.cudaStreamCaptureStatusNone
    ACTIVE = cudart.cudaStreamCaptureStatus.cudaStreamCaptureStatusActive
    INVALIDATED = cudart.cudaStreamCaptureStatus.cudaStreamCaptureStatusInvalidated


@dataclass(frozen=True)
class CaptureInfo:
    """What a stream is capturing: status, the capture sequence id, and the
    nodes the next captured operation would depend on (as integer handles)."""

    status: CaptureStatus
    capture_id: int = 0
    dependencies: tuple[int, ...] = ()


def begin_capture(stream: StreamLike, mode: CaptureMode | str = CaptureMode.GLOBAL) -> None:
    """Start capturing ``stream`` into a new graph (``cudaStreamBeginCapture``)."""
    # ``_value_``, the member's plain attribute: ``.value`` is a descriptor, slower, and this runs at every break.
    check(
        cudart.cudaStreamBeginCapture(stream_handle(stream), CaptureMode.parse(mode)._value_),
        "cudaStreamBeginCapture",
    )


def end_capture(stream: StreamLike) -> Graph:
    """End the capture on ``stream`` and return the captured graph (``cudaStreamEndCapture``).

    An invalidated capture raises ``CudaError`` (``cudaErrorStreamCaptureInvalidated``);
    the stream has left capture mode either way.
    """
    graph = check(cudart.cudaStreamEndCapture(stream_handle(stream)), "cudaStreamEndCapture")
    return Graph(graph)


def discard_capture(stream: StreamLike) -> None:
    """End the capture open on ``stream``, if any, and destroy what it captured (after a
    failure). An invalidated capture's error is swallowed: the stream has left capture
    mode either way, and the error that caused the failure is the one to report."""
    try:
        if capture_status(stream) is not CaptureStatus.NONE:
            end_capture(stream).destroy()
    except CudaError:
        pass


def capture_status(stream: StreamLike) -> CaptureStatus:
    """``cudaStreamIsCapturing``."""
    status = check(cudart.cudaStreamIsCapturing(stream_handle(stream)), "cudaStreamIsCapturing")
    return CaptureStatus(status)


def capture_info(stream: StreamLike) -> CaptureInfo:
    """``cudaStreamGetCaptureInfo``: status, capture id and current dependency nodes."""
    values = check(cudart.cudaStreamGetCaptureInfo(stream_handle(stream)), "cudaStreamGetCaptureInfo")
    status, capture_id, dependencies = CaptureStatus(values[0]), values[1], values[3]
    if status is not CaptureStatus.ACTIVE:
        return CaptureInfo(status)
    return CaptureInfo(status, int(capture_id), tuple(int(node) for node in dependencies or ()))


def exchange_capture_mode(mode: CaptureMode | str) -> CaptureMode:
    """Set this thread's capture interaction mode; return the previous one."""
    previous = check(
        cudart.cudaThreadExchangeStreamCaptureMode(CaptureMode.parse(mode).value),
        "cudaThreadExchangeStreamCaptureMode",
    )
    return CaptureMode(previous)
