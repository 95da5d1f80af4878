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
segment (:mod:`breakgraph.recording.break_streams`): the tracker, and while a
break runs its :class:`~breakgraph.recording.break_watch.BreakWatch`, hand such
waits to the break's :class:`~breakgraph.recording.break_ordering.BreakOrdering`,
which keeps their order at replay.

The hooks that report to the tracker live in :mod:`breakgraph.recording.stream_hooks`.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

import breakgraph_bindings as bindings
from breakgraph_bindings import CaptureInfo, CaptureStatus
from breakgraph.recording.break_streams import BreakStreams, RecordedBreak
from breakgraph.recording.break_watch import BreakWatch
from breakgraph.recording.event_records import BreakRecord, EventRecords, SegmentRecord
from breakgraph.recording.stream_hooks import original_record


class CaptureInfoProvider(Protocol):
    def __call__(self, stream: torch.cuda.Stream) -> CaptureInfo: ...


class StreamJoinError(RuntimeError):
    """A side stream cannot be joined back into the capture stream, or a segment's wait on
    a stream outside the capture cannot be ordered at replay."""


_UNJOINED = "capturing stream has unjoined work"  # cudaErrorStreamCaptureUnjoined's text, in torch's errors and ours


def unseen_fork(error: BaseException, following: str) -> StreamJoinError | None:
    """CUDA's refusal to end the segment before ``following`` (a break's call, ``cond()``,
    ``while_loop()``, the random op where torch goes on recording, or "end") for a stream forked
    into it and never joined, as an error that says why breakgraph did not join it and how to;
    None for any other error."""
    if not isinstance(error, RuntimeError) or _UNJOINED not in str(error):
        return None
    if following == "end":
        where = "the capture's end"
    elif following.endswith("()"):
        where = following
    else:
        where = f"the random op {following} (a segment ends at its first random op, for torch to record the rest)"
    return StreamJoinError(
        f"the segment before {where} cannot end: a stream forked into it still has work the capture stream "
        "does not wait on, forked where breakgraph's hooks do not see (a generic torch.Stream's own "
        "wait_stream, or an event recorded in C++, such as an async collective's). Join it before that "
        "point: torch.cuda.current_stream().wait_stream(side), or work.wait() for an async collective; or fork "
        "it with torch.cuda.Stream.wait_stream or a torch.cuda.Event, which breakgraph sees and joins at "
        "every break"
    )  # CUDA's own words stay in the cause: here they would read as an op the capture refused


def _stream_id(stream: torch.cuda.Stream) -> int:
    return stream.cuda_stream


class ForkJoinTracker:
    """Which side streams of one capture are forked and not yet joined.

    ``capture_info`` answers what a stream is capturing (the bindings'
    ``capture_info`` on a GPU, a fake in the state-machine tests); ``join`` and
    ``fork`` make the capture stream wait on a side stream and the reverse,
    bypassing the hooks; ``record`` records an event, bypassing them too, and
    ``wait_external`` makes a capturing stream wait on an event recorded
    outside the capture (an event-wait node). What a running break does with
    events and streams is :attr:`breaks`'s to watch.
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
        self._wait_external = wait_external or _wait_on_outside_event
        self._capture_id: int | None = None  # asked of CUDA when a hook first needs it
        self._segment_number = 0
        self._streams: dict[int, torch.cuda.Stream] = {}  # every side stream seen this segment
        self._open: set[int] = set()  # forked, with work not yet joined
        self._joined_at: dict[int, tuple[int, ...]] = {}  # dependencies when last joined
        self._carry: list[torch.cuda.Stream] = []  # open at the last segment end: fork again
        self._events = EventRecords()  # held to the capture's end (:meth:`capture_ended`)
        self._took_part: set[int] = set()  # every side stream seen in any segment
        self._break_streams = BreakStreams(capture_stream, self._wait_external)
        self.breaks = BreakWatch(capture_stream, self._events, self._break_streams, self._took_part, fork, record or original_record)

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
            self._events.recorded(event, SegmentRecord(stream, self._segment_number, info))
        else:
            self._events.recorded_outside(event)

    def capture_ended(self) -> None:
        """Let go of the events recorded into the capture's segments, now that none captures."""
        self._events.clear()

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
        entry = self._events.get(event)
        if entry is None or (isinstance(entry, SegmentRecord) and entry.segment == self._segment_number):
            return False
        if isinstance(entry, BreakRecord) and _stream_id(entry.stream) != _stream_id(self.capture_stream):
            self._require_capture_device(entry.stream, f"a segment waits on an event a break recorded on stream {_stream_id(entry.stream):#x}")
            if not self._in_this_capture(self._capture_info(stream)):
                self._follow_capture_stream(stream)
            self._wait_external(stream, entry.ordering.signal_on(_stream_id(entry.stream)))
        else:
            self._follow_capture_stream(stream)
        return True

    def event_waited(self, event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        entry = self._events.of_segment(event)
        if entry is not None:
            self.stream_waited(stream, entry.stream, entry.info)

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

    # -- breaks: what each does with events and streams, :attr:`breaks` watches ------
    # The recorder calls these; the hooks call :attr:`breaks` itself. A break's
    # streams are noted by the number of the segment before it, which the tracker counts.
    def break_begun(self) -> None:
        """A break's function runs now (eagerly): events it records and waits on may cross."""
        self.breaks.begun(self._segment_number)

    def break_ended(self, recorded: RecordedBreak) -> None:
        """The break is over, and ``recorded`` replays it (:meth:`BreakWatch.ended`)."""
        self.breaks.ended(recorded)

    def break_discarded(self) -> None:
        """The break raised, or could not be recorded (:meth:`BreakWatch.discarded`)."""
        self.breaks.discarded()


def _wait_on_outside_event(stream: torch.cuda.Stream, event: bindings.Event) -> None:
    bindings.wait_event(stream, event, external=True)
