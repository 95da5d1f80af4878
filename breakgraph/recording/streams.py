"""Fork/join tracking for side streams, so a segment can end inside an overlap region.

A CUDA capture cannot end while a stream forked from it still has unjoined
work. While a capture is active, ``torch.cuda.Stream.wait_stream`` and
``torch.cuda.Event.record``/``wait`` are hooked: a side stream that waits on
a capturing stream is *forked*; the capture stream waiting on it *joins* it.
Before a segment ends the tracker joins every forked stream that has work
the capture stream does not wait on yet, and after the next segment begins
it forks those streams again, so model code keeps using them across a break.

An event recorded in a break and waited on in a later segment, or recorded
in a segment and waited on in a later break, crosses a segment boundary, which
CUDA refuses; so does a stream a break queued work on, used by a later
segment (:mod:`breakgraph.recording.break_streams`): the tracker hands such
waits to the break's :class:`~breakgraph.recording.break_ordering.BreakOrdering`,
which keeps their order at replay.

The hooks that report to the tracker live in :mod:`breakgraph.recording.stream_hooks`.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Protocol

import torch

import breakgraph_bindings as bindings
from breakgraph_bindings import CaptureInfo, CaptureStatus
from breakgraph.recording.break_ordering import BreakOrdering
from breakgraph.recording.break_streams import BreakStreams, RecordedBreak
from breakgraph.recording.stream_hooks import original_record


class CaptureInfoProvider(Protocol):
    def __call__(self, stream: torch.cuda.Stream) -> CaptureInfo: ...


class StreamJoinError(RuntimeError):
    """A side stream cannot be joined back into the capture stream, or a segment's wait on
    a stream outside the capture cannot be ordered at replay."""


def _stream_id(stream: torch.cuda.Stream) -> int:
    return stream.cuda_stream


class _SegmentRecord(NamedTuple):
    """An event recorded into segment number ``segment``, on ``stream``, as of ``info``."""

    stream: torch.cuda.Stream
    segment: int
    info: CaptureInfo


class _BreakRecord(NamedTuple):
    """An event recorded on ``stream`` while a break ran, whose replay keeps ``ordering``."""

    stream: torch.cuda.Stream
    ordering: BreakOrdering


class ForkJoinTracker:
    """Which side streams of one capture are forked and not yet joined.

    ``capture_info`` answers what a stream is capturing (the bindings'
    ``capture_info`` on a GPU, a fake in the state-machine tests); ``join`` and
    ``fork`` make the capture stream wait on a side stream and the reverse,
    bypassing the hooks; ``record`` records an event, bypassing them too, and
    ``wait_external`` makes a capturing stream wait on an event recorded
    outside the capture (an event-wait node).
    """

    def __init__(
        self,
        capture_stream: torch.cuda.Stream,
        capture_info: CaptureInfoProvider,
        join: Callable[[torch.cuda.Stream, torch.cuda.Stream], None],
        fork: Callable[[torch.cuda.Stream, torch.cuda.Stream], None],
        record: Callable[[torch.cuda.Event, torch.cuda.Stream], None] | None = None,
        wait_external: Callable[[torch.cuda.Stream, bindings.Event], None] | None = None,
    ):
        self.capture_stream = capture_stream
        self._capture_info = capture_info
        self._join = join
        self._fork = fork
        self._record = record or original_record
        self._wait_external = wait_external or _wait_on_outside_event
        self._capture_id: int | None = None  # asked of CUDA when a hook first needs it
        self._segment_number = 0
        self._streams: dict[int, torch.cuda.Stream] = {}  # every side stream seen this segment
        self._open: set[int] = set()  # forked, with work not yet joined
        self._joined_at: dict[int, tuple[int, ...]] = {}  # dependencies when last joined
        self._carry: list[torch.cuda.Stream] = []  # open at the last segment end: fork again
        # What each event recorded into a segment or a break stands for (None: re-recorded
        # outside the capture since); the events are held to the capture's end (:meth:`capture_ended`).
        self._recorded_on: dict[torch.cuda.Event, _SegmentRecord | _BreakRecord | None] = {}
        self._recorded_again: set[torch.cuda.Event] = set()  # segments' events recorded again in a break
        self._took_part: set[int] = set()  # every side stream seen in any segment
        self._in_break = False  # while a break's function runs
        self._break: BreakOrdering | None = None  # that break's, made once an event crosses it
        self._break_side_streams: set[int] = set()  # the capture device's side streams that break worked on
        self._break_streams = BreakStreams(capture_stream, self._wait_external)

    # -- segment boundaries ---------------------------------------------------
    def segment_begun(self) -> None:
        """Fork again the streams that were open when the previous segment ended."""
        self._capture_id = None
        self._segment_number += 1
        if not self._carry:  # the common case: no side stream was open
            return
        carry, self._carry = self._carry, []
        for stream in carry:
            self._fork(stream, self.capture_stream)
            self._note_fork(stream)

    @property
    def capture_id(self) -> int:
        """The open segment's CUDA capture id, queried once per segment and only if needed."""
        if self._capture_id is None:
            self._capture_id = self._capture_info(self.capture_stream).capture_id
        return self._capture_id

    def segment_ending(self) -> tuple[int, ...]:
        """Join every side stream with unjoined work; return the ids that took part."""
        if not self._streams:  # the common case: the segment used the capture stream alone
            return ()
        took_part = tuple(self._streams)
        for sid, stream in list(self._streams.items()):
            info = self._capture_info(stream)
            if info.status is CaptureStatus.NONE:
                continue  # never became part of this capture: nothing to join
            if info.status is CaptureStatus.INVALIDATED:
                raise StreamJoinError(
                    f"side stream {sid:#x} was forked from capture stream {_stream_id(self.capture_stream):#x} "
                    "but its capture was invalidated by an error on that stream; fix the failing "
                    "operation on the side stream (or run it in an @eager_on_graph function)"
                )
            if info.capture_id != self.capture_id:
                raise StreamJoinError(
                    f"side stream {sid:#x} is capturing into another capture (id {info.capture_id}) than "
                    f"capture stream {_stream_id(self.capture_stream):#x} (id {self.capture_id}); "
                    "a stream can take part in one capture at a time: give each capture its own side streams"
                )
            if sid in self._open or self._joined_at.get(sid) != info.dependencies:
                self._join(self.capture_stream, stream)
                self._carry.append(stream)
        self._streams.clear()
        self._open.clear()
        self._joined_at.clear()
        return took_part

    # -- what the hooks report -----------------------------------------------
    def stream_waited(self, waiter: torch.cuda.Stream, source: torch.cuda.Stream, source_info: CaptureInfo | None = None) -> None:
        """``waiter`` now waits on ``source``'s work (as of ``source_info``, default: now)."""
        info = self._capture_info(source) if source_info is None else source_info
        if not self._in_this_capture(info):
            return  # source is not part of this capture: nothing forks or joins
        waiter_id, source_id = _stream_id(waiter), _stream_id(source)
        if waiter_id == source_id:
            return
        if waiter_id == _stream_id(self.capture_stream):
            if source_id in self._streams:
                self._open.discard(source_id)
                self._joined_at[source_id] = info.dependencies
            return
        self._note_fork(waiter)

    def event_recorded(self, event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        info = self._capture_info(stream)
        if self._in_this_capture(info):
            self._recorded_on[event] = _SegmentRecord(stream, self._segment_number, info)
            self._recorded_again.discard(event)  # its record is inside this capture again
        elif event in self._recorded_on:
            self._recorded_on[event] = None

    def capture_ended(self) -> None:
        """Let go of the events recorded into the capture's segments, now that none captures.
        Held until here, no such event is destroyed while a later segment captures on its
        stream, wherever the user's code drops it (a break included): ``torch.cuda.graph``'s
        users destroy an event recorded in a capture only once no capture of its stream runs."""
        self._recorded_on.clear()
        self._recorded_again.clear()

    def waited_in_segment(self, event: torch.cuda.Event, stream: torch.cuda.Stream) -> bool:
        """``stream`` waits on ``event`` inside the open segment. True where the event
        stands for work outside this segment's capture, and the wait is made here:

        - recorded in an earlier segment, or in a break on the capture stream: by replay
          order that work is done before this segment starts, so ``stream`` only
          follows the capture stream;
        - recorded in a break on another stream: ``stream`` (forked into the capture if it
          was not in it) waits on the event the break's replay records on that stream,
          an event-wait node.
        """
        entry = self._recorded_on.get(event)
        if entry is None or (isinstance(entry, _SegmentRecord) and entry.segment == self._segment_number):
            return False
        if isinstance(entry, _BreakRecord) and _stream_id(entry.stream) != _stream_id(self.capture_stream):
            self._require_capture_device(entry.stream, f"a segment waits on an event a break recorded on stream {_stream_id(entry.stream):#x}")
            if not self._in_this_capture(self._capture_info(stream)):
                self._follow_capture_stream(stream)
            self._wait_external(stream, entry.ordering.signal_on(_stream_id(entry.stream)))
        else:
            self._follow_capture_stream(stream)
        return True

    def waited_on_uncaptured_stream(self, waiter: torch.cuda.Stream, source: torch.cuda.Stream) -> bool:
        """``waiter``, capturing, waits on ``source``, which is not in the capture. True where
        the wait is made here, as CUDA refuses it: where a break queued work on ``source``
        that no graph waits for yet, ``waiter`` waits on an event the latest break's replay
        records there (an event-wait node), so at replay the graph waits for what every
        break up to it queued on ``source``; where earlier graphs hold ``source``'s work,
        replay order keeps the wait. False where the wait is CUDA's to make: ``source`` is in
        a capture, or ``waiter`` is in none. Raises where nothing stands for ``source``'s work,
        or ``waiter`` captures a conditional body."""
        sid = _stream_id(source)
        if sid == _stream_id(self.capture_stream) or sid in self._streams or self._capture_info(source).status is not CaptureStatus.NONE:
            return False
        if _stream_id(waiter) != _stream_id(self.capture_stream):
            info = self._capture_info(waiter)
            if info.status is not CaptureStatus.ACTIVE:
                return False
            if info.capture_id != self.capture_id:
                raise StreamJoinError(
                    f"stream {_stream_id(waiter):#x}, capturing a conditional body, waits on stream {sid:#x}, which "
                    "is not in the capture: a graph cannot wait there on work outside it. Make the wait before the "
                    "breakgraph.cond or while_loop"
                )
        if sid in self._break_streams:
            self._require_capture_device(source, f"a segment waits on stream {sid:#x}", ", on which a break queued work")
            self._break_streams.wait_for(waiter, source, self._segment_number)  # no-op where a graph waits already
            return True
        if sid in self._took_part:
            return True
        raise StreamJoinError(
            f"a segment waits on stream {sid:#x}, which is not in the capture, and on which no break queued work "
            "that breakgraph saw: its work ran outside the graphs (before the capture, or in this segment without "
            "forking it first), which a graph cannot wait on. Fork a side stream into the capture before using it "
            "(side.wait_stream(torch.cuda.current_stream())), or wait on it outside the captured code or inside an "
            "@eager_on_graph function"
        )

    def _in_this_capture(self, info: CaptureInfo) -> bool:
        """Whether ``info`` is of a stream capturing into the open segment."""
        return info.status is CaptureStatus.ACTIVE and info.capture_id == self.capture_id

    def _require_capture_device(self, stream: torch.cuda.Stream, what: str, which: str = "") -> None:
        """Refuse ``what`` (on ``stream``, ``which``) where ``stream`` is another device's: a
        break's signals live on the capture's."""
        if stream.device_index != self.capture_stream.device_index:
            raise StreamJoinError(
                f"{what} of cuda:{stream.device_index}{which}, while the capture runs on cuda:{self.capture_stream.device_index}: "
                "breakgraph orders a break's events and streams on the capture's device only; make the break wait "
                "for that stream before it returns (torch.cuda.current_stream().wait_stream(...))"
            )

    def _follow_capture_stream(self, stream: torch.cuda.Stream) -> None:
        """``stream`` waits on the capture stream's work so far: a fork, where it is another."""
        if _stream_id(stream) != _stream_id(self.capture_stream):
            self._fork(stream, self.capture_stream)
            self._note_fork(stream)

    # -- breaks -----------------------------------------------------------------
    def break_begun(self) -> None:
        """A break's function runs now (eagerly): events it records and waits on may cross."""
        self._in_break, self._break = True, None

    def break_ended(self, recorded: RecordedBreak) -> None:
        """The break is over, and ``recorded`` replays it: it takes what the break orders
        across its boundaries (None where no event crossed it), to which later segments'
        waits on the break's events and streams add. Where it writes a result back, the
        writeback waits for what it queued on side streams of the capture's device: its result
        may be their work, which eager code may leave for the caller to wait on. Whether the
        break joined them is not asked: it may queue more work there after a join, which the
        hooks do not see."""
        self._in_break = False
        if self._break_side_streams:  # rare: most breaks touch no side stream
            if recorded.writes_back:
                for sid in self._break_side_streams:
                    self._ordering().write_back_after(sid)
            self._break_side_streams.clear()
        recorded.ordering = self._break
        self._break_streams.latest = recorded

    def break_discarded(self) -> None:
        """The break raised, or could not be recorded: nothing records its events at replay,
        so a later segment's wait on one goes to CUDA, which refuses it."""
        self._in_break = False
        self._break_side_streams.clear()
        for event, entry in self._recorded_on.items():
            if isinstance(entry, _BreakRecord) and entry.ordering is self._break:
                self._recorded_on[event] = None

    def _ordering(self) -> BreakOrdering:
        if self._break is None:
            self._break = BreakOrdering()
        return self._break

    def event_recorded_in_break(self, event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        if self._in_break:
            self._note_break_stream(stream)
            self._recorded_on[event] = _BreakRecord(stream, self._ordering())
        elif event in self._recorded_on:  # between segments, outside a break (a barrier's)
            self._recorded_on[event] = None

    def waited_in_break(self, event: torch.cuda.Event, stream: torch.cuda.Stream) -> bool:
        """``stream`` waits on ``event`` in a break. True where the event was recorded in a
        segment, and the wait is made here: ``stream`` follows the capture stream, at capture
        and, before the break, at every replay. The first such wait records the event again
        on the capture stream, outside the capture: one recorded in a capture cannot be
        waited on outside it, nor at replay, by the break's own code."""
        if not self._in_break:
            return False
        self._note_break_stream(stream)
        if not isinstance(self._recorded_on.get(event), _SegmentRecord):
            return False
        self._follow_segments(stream)
        self._record_again(event)
        return True

    def synchronized_in_break(self, event: torch.cuda.Event) -> None:
        """The host synchronizes with or queries ``event`` in a break. Where a segment recorded
        it, it is recorded again on the capture stream, outside the capture, so the call is
        valid now; and before every replay of the break the host waits for the graphs
        launched so far, which hold the work the event stood for (the break's code may hold
        another event object then, made by an eager call in between)."""
        if not self._in_break or not isinstance(self._recorded_on.get(event), _SegmentRecord):
            return
        self._ordering().wait_on_host()
        self._record_again(event)

    def _record_again(self, event: torch.cuda.Event) -> None:
        """Record a segment's ``event`` on the capture stream, outside the capture, once per
        segment record: one recorded in a capture cannot be waited on outside it."""
        if event not in self._recorded_again:
            self._record(event, self.capture_stream)
            self._recorded_again.add(event)

    def stream_waited_in_break(self, waiter: torch.cuda.Stream, source: torch.cuda.Stream) -> None:
        """``waiter`` waits on ``source`` in a break: where ``source`` took part in a segment,
        its work there ran in the graphs, so ``waiter`` follows them too."""
        if not self._in_break:
            return
        self._note_break_stream(waiter)
        if _stream_id(source) in self._took_part:
            self._follow_segments(waiter)

    def _follow_segments(self, stream: torch.cuda.Stream) -> None:
        """In a break, ``stream`` (unless the capture stream, which replay orders) waits on the
        capture stream's work: now, and before the break at every replay."""
        if _stream_id(stream) != _stream_id(self.capture_stream):
            self._fork(stream, self.capture_stream)
            self._ordering().follow(_stream_id(stream))

    def event_waited(self, event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        entry = self._recorded_on.get(event)
        if isinstance(entry, _SegmentRecord):
            self.stream_waited(stream, entry.stream, entry.info)

    def _note_break_stream(self, stream: torch.cuda.Stream) -> None:
        """A break waits or records on ``stream``: it queues work there, which a later segment
        that uses the stream waits on."""
        sid = _stream_id(stream)
        if sid != _stream_id(self.capture_stream):
            self._break_streams.worked_on(sid, self._segment_number)
            if stream.device_index == self.capture_stream.device_index:
                self._break_side_streams.add(sid)

    def _note_fork(self, stream: torch.cuda.Stream) -> None:
        """``stream`` takes part in the open segment now; where a break queued work on it, the
        segment's graph first waits on that work, as the stream's order asks."""
        sid = _stream_id(stream)
        self._took_part.add(sid)
        self._streams[sid] = stream
        self._open.add(sid)
        self._joined_at.pop(sid, None)
        if sid in self._break_streams:
            self._break_streams.wait_for(stream, stream, self._segment_number)

    @property
    def open_streams(self) -> tuple[int, ...]:
        return tuple(sorted(self._open))


def _wait_on_outside_event(stream: torch.cuda.Stream, event: bindings.Event) -> None:
    bindings.wait_event(stream, event, external=True)
