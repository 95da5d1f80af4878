"""What a break, while it runs eagerly during a capture, does with the capture's events and streams.

A break's code may wait on an event a segment recorded, synchronize with one,
record one a later segment waits on, or queue work on a side stream. Each
crosses a segment boundary, which CUDA refuses; the watch makes the wait valid
now and hands what replay must keep to the break's
:class:`~breakgraph.recording.break_ordering.BreakOrdering`.
"""

from __future__ import annotations

from typing import Callable

import torch

from breakgraph.recording.break_ordering import BreakOrdering
from breakgraph.recording.break_streams import BreakStreams, RecordedBreak
from breakgraph.recording.event_records import BreakRecord, EventRecords


class BreakWatch:
    """The running break of one capture: the events and streams it uses.

    ``events`` and ``break_streams`` are shared with the capture's fork/join tracker,
    as is ``took_part``, the side streams seen in any segment; ``fork`` makes a stream
    wait on another and ``record`` records an event, both bypassing the hooks.
    """

    def __init__(
        self,
        capture_stream: torch.cuda.Stream,
        events: EventRecords,
        break_streams: BreakStreams,
        took_part: set[int],
        fork: Callable[[torch.cuda.Stream, torch.cuda.Stream], None],
        record: Callable[[torch.cuda.Event, torch.cuda.Stream], None],
    ):
        self._capture_stream = capture_stream
        self._events = events
        self._break_streams = break_streams
        self._took_part = took_part
        self._fork = fork
        self._record = record
        self._running = False
        self._segment = 0  # the number of the segment before the running break
        self._ordering_made: BreakOrdering | None = None  # made once an event crosses the break
        self._side_streams: set[int] = set()  # the capture device's side streams the break worked on

    def begun(self, segment: int) -> None:
        """A break's function runs now, after segment number ``segment``."""
        self._running, self._segment, self._ordering_made = True, segment, None

    def ended(self, recorded: RecordedBreak) -> None:
        """The break is over, and ``recorded`` replays it: it takes what the break orders
        across its boundaries (None where no event crossed it), to which later segments'
        waits on the break's events and streams add. Where it writes a result back, the
        writeback waits for what it queued on side streams of the capture's device: its result
        may be their work, which eager code may leave for the caller to wait on. Whether the
        break joined them is not asked: it may queue more work there after a join, which the
        hooks do not see."""
        self._running = False
        if self._side_streams:  # rare: most breaks touch no side stream
            if recorded.writes_back:
                for sid in self._side_streams:
                    self._ordering().write_back_after(sid)
            self._side_streams.clear()
        recorded.ordering = self._ordering_made
        self._break_streams.latest = recorded

    def discarded(self) -> None:
        """The break raised, or could not be recorded: nothing records its events at replay,
        so a later segment's wait on one goes to CUDA, which refuses it."""
        self._running = False
        self._side_streams.clear()
        if self._ordering_made is not None:
            self._events.forget_break(self._ordering_made)

    def _ordering(self) -> BreakOrdering:
        if self._ordering_made is None:
            self._ordering_made = BreakOrdering()
        return self._ordering_made

    # -- what the hooks report, between segments --------------------------------
    def event_recorded(self, event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        if self._running:
            self._worked_on(stream)
            self._events.recorded(event, BreakRecord(stream, self._ordering()))
        else:  # between segments, outside a break (a barrier's)
            self._events.recorded_outside(event)

    def event_waited(self, event: torch.cuda.Event, stream: torch.cuda.Stream) -> bool:
        """``stream`` waits on ``event``. True where the event was recorded in a segment, and
        the wait is made here: ``stream`` follows the capture stream, at capture and, before
        the break, at every replay. The first such wait records the event again on the
        capture stream, outside the capture: one recorded in a capture cannot be waited on
        outside it, nor at replay, by the break's own code."""
        if not self._running:
            return False
        self._worked_on(stream)
        if self._events.of_segment(event) is None:
            return False
        self._follow_segments(stream)
        self._record_again(event)
        return True

    def event_synchronized(self, event: torch.cuda.Event) -> None:
        """The host synchronizes with or queries ``event``. Where a segment recorded it, it is
        recorded again on the capture stream, outside the capture, so the call is valid now;
        and before every replay of the break the host waits for the graphs launched so far,
        which hold the work the event stood for (the break's code may hold another event
        object then, made by an eager call in between)."""
        if not self._running or self._events.of_segment(event) is None:
            return
        self._ordering().wait_on_host()
        self._record_again(event)

    def stream_waited(self, waiter: torch.cuda.Stream, source: torch.cuda.Stream) -> None:
        """``waiter`` waits on ``source``: where ``source`` took part in a segment, its work
        there ran in the graphs, so ``waiter`` follows them too."""
        if not self._running:
            return
        self._worked_on(waiter)
        if source.cuda_stream in self._took_part:
            self._follow_segments(waiter)

    def _record_again(self, event: torch.cuda.Event) -> None:
        """Record a segment's ``event`` on the capture stream, outside the capture, once per
        segment record: one recorded in a capture cannot be waited on outside it."""
        if not self._events.rerecorded(event):
            self._record(event, self._capture_stream)
            self._events.mark_rerecorded(event)

    def _follow_segments(self, stream: torch.cuda.Stream) -> None:
        """``stream`` (unless the capture stream, which replay orders) waits on the capture
        stream's work: now, and before the break at every replay."""
        if stream.cuda_stream != self._capture_stream.cuda_stream:
            self._fork(stream, self._capture_stream)
            self._ordering().follow(stream.cuda_stream)

    def _worked_on(self, stream: torch.cuda.Stream) -> None:
        """The break waits or records on ``stream``: it queues work there, which a later
        segment that uses the stream waits on."""
        sid = stream.cuda_stream
        if sid != self._capture_stream.cuda_stream:
            self._break_streams.worked_on(sid, self._segment)
            if stream.device_index == self._capture_stream.device_index:
                self._side_streams.add(sid)
