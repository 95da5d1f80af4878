"""Stream handles from whatever the caller holds."""

from __future__ import annotations

from typing import Protocol, Union

from cuda.bindings import runtime as cudart

from .errors import check


class HasCudaStream(Protocol):
    """A stream object that holds its raw handle as ``cuda_stream`` (``torch.cuda.Stream``)."""

    cuda_stream: int


StreamLike = Union[cudart.cudaStream_t, int, HasCudaStream]
"""What every call here takes as a stream: a ``cudaStream_t``, a raw handle, or a stream object."""

StreamHandle = cudart.cudaStream_t
"""A stream as the raw calls take it (:func:`stream_handle` makes one): replay binds it once."""

_HANDLES: dict[int, StreamHandle] = {}


def stream_handle(stream: StreamLike) -> StreamHandle:
    """Return a ``cudaStream_t`` for ``stream``.

    Accepts a ``cudaStream_t``, an integer handle, or any object with a
    ``cuda_stream`` integer attribute (``torch.cuda.Stream``). Handles are
    cached by value, so repeated calls cost a dict lookup.
    """
    if isinstance(stream, cudart.cudaStream_t):
        return stream
    raw = getattr(stream, "cuda_stream", stream)
    if not isinstance(raw, int):
        raise TypeError(
            f"expected a torch.cuda.Stream, an int handle or a cudaStream_t, got {type(stream).__name__}"
        )
    handle = _HANDLES.get(raw)
    if handle is None:
        handle = _HANDLES[raw] = cudart.cudaStream_t(raw)
    return handle


def synchronize(stream: StreamLike) -> None:
    """Wait for all work on ``stream`` (``cudaStreamSynchronize``); errors name the CUDA error."""
    check(cudart.cudaStreamSynchronize(stream_handle(stream)), "cudaStreamSynchronize")


def new_stream() -> int:
    """A new non-blocking stream's raw handle (``cudaStreamCreateWithFlags``), outside
    torch's pool of 32 per device, which hands streams out again: for a stream that must
    never be one a capture already uses."""
    return int(check(cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking), "cudaStreamCreateWithFlags"))
