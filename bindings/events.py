"""Events a capture's graphs wait on from outside it."""

from __future__ import annotations

from cuda.bindings import runtime as cudart

from .errors import check
from .graph import _Owned
from .streams import StreamLike, stream_handle

_WAIT_FLAGS = {False: cudart.cudaEventWaitDefault, True: cudart.cudaEventWaitExternal}


class Event(_Owned):
    """An owned ``cudaEvent_t`` without timing, made on the current device
    (``cudaEventCreateWithFlags``)."""

    __slots__ = ()
    _destroy = staticmethod(cudart.cudaEventDestroy)

    def __init__(self) -> None:
        super().__init__(check(cudart.cudaEventCreateWithFlags(cudart.cudaEventDisableTiming), "cudaEventCreateWithFlags"))

    def record(self, stream: StreamLike) -> None:
        """Stand for ``stream``'s work queued so far (``cudaEventRecord``)."""
        check(cudart.cudaEventRecord(self.handle, stream_handle(stream)), "cudaEventRecord")

    def synchronize(self) -> None:
        """Block the host until the work it stands for is done (``cudaEventSynchronize``)."""
        check(cudart.cudaEventSynchronize(self.handle), "cudaEventSynchronize")


def wait_event(stream: StreamLike, event: Event, external: bool = False) -> None:
    """Make ``stream``'s later work wait for ``event`` (``cudaStreamWaitEvent``). With
    ``external``, on a capturing stream, the wait becomes an event-wait node of the graph:
    each launch of it waits for the event's latest record, made outside the capture."""
    check(cudart.cudaStreamWaitEvent(stream_handle(stream), event.handle, _WAIT_FLAGS[external]), "cudaStreamWaitEvent")
