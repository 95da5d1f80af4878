"""The side streams breaks queue work on, and which graph last waited for that work.

A break that waits or records on a side stream queues work there (``comm.wait_stream(...)``,
then work on ``comm``), which replay runs eagerly, outside the graphs. A later segment that
uses the stream (waits on it, forks it again, or keeps it across the break) must wait for
that work first, as the stream's own order asks. It waits on the event the latest break's
replay records on the stream (:meth:`BreakOrdering.signal_on
<breakgraph.recording.break_ordering.BreakOrdering.signal_on>`), once: later graphs follow
the one that waited, so only work a later break queues needs another wait.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

import breakgraph_bindings as bindings
from breakgraph.recording.break_ordering import BreakOrdering


class RecordedBreak(Protocol):
    """A break as a segment of the replay: what its replay orders across its boundaries
    (None: nothing), and whether it writes a result back."""

    ordering: BreakOrdering | None

    @property
    def writes_back(self) -> bool: ...


class BreakStreams:
    """For one capture: the side streams breaks queued work on, each by the number of the
    segment before that break, and the number of the segment whose graph last waited for
    that work. Within one segment, each waiting stream waits for itself."""

    def __init__(self, capture_stream: torch.cuda.Stream, wait_external: Callable[[torch.cuda.Stream, bindings.Event], None]):
        self._capture_stream = capture_stream
        self._wait_external = wait_external
        self.latest: RecordedBreak | None = None  # the latest break recorded for replay
        self._worked_in: dict[int, int] = {}
        self._waited_in: dict[int, int] = {}
        self._waited_by: dict[tuple[int, int], int] = {}  # (waiter, source) -> the segment it waited in

    def __contains__(self, raw_stream: int) -> bool:
        """Whether a break queued work on ``raw_stream``."""
        return raw_stream in self._worked_in

    def worked_on(self, raw_stream: int, segment: int) -> None:
        """A break after segment number ``segment`` waits or records on ``raw_stream``."""
        self._worked_in[raw_stream] = segment

    def wait_for(self, waiter: torch.cuda.Stream, source: torch.cuda.Stream, segment: int) -> None:
        """Make ``waiter``, capturing segment number ``segment``, wait for the work breaks
        queued on ``source``, where that wait is owed: where no earlier graph waits for that
        work, nor ``waiter`` in this one. Another device's stream is left alone: the signal
        lives on the capture's."""
        sid = source.cuda_stream
        pair = (waiter.cuda_stream, sid)
        if (
            self.latest is None
            or sid not in self._worked_in
            or self._worked_in[sid] < self._waited_in.get(sid, 0) < segment
            or self._waited_by.get(pair) == segment
            or source.device_index != self._capture_stream.device_index
        ):
            return
        if self.latest.ordering is None:
            self.latest.ordering = BreakOrdering()
        self._wait_external(waiter, self.latest.ordering.signal_on(sid))
        self._waited_in[sid] = self._waited_by[pair] = segment
