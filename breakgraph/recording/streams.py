"""Fork/join tracking for side streams, so a segment can end inside an overlap region.

A CUDA capture cannot end while a stream forked from it still has unjoined
work. While a capture is active, ``torch.cuda.Stream.wait_stream`` and
``torch.cuda.Event.record``/``wait`` are hooked: a side stream that waits on
a capturing stream is *forked*; the capture stream waiting on it *joins* it.
Before a segment ends the tracker joins every forked stream that has work
the capture stream does not wait on yet, and after the next segment begins
it forks those streams again, so model code keeps using them across a break.

The hooks are installed when the first capture starts and removed when the
last one ends (reference-counted under a lock). Outside a capture of the
calling thread they call straight through to torch's methods.
"""

from __future__ import annotations

import threading
from typing import Callable, Protocol

import torch

from breakgraph_bindings import CaptureInfo, CaptureStatus
from breakgraph.base import context


class CaptureInfoProvider(Protocol):
    def __call__(self, stream: torch.cuda.Stream) -> CaptureInfo: ...


class StreamJoinError(RuntimeError):
    """A side stream cannot be joined back into the capture stream."""


def _stream_id(stream: torch.cuda.Stream) -> int:
    return stream.cuda_stream


class ForkJoinTracker:
    """Which side streams of one capture are forked and not yet joined.

    ``capture_info`` answers what a stream is capturing (the bindings'
    ``capture_info`` on a GPU, a fake in the state-machine tests); ``join`` and
    ``fork`` make the capture stream wait on a side stream and the reverse,
    bypassing the hooks.
    """

    def __init__(
        self,
        capture_stream: torch.cuda.Stream,
        capture_info: CaptureInfoProvider,
        join: Callable[[torch.cuda.Stream, torch.cuda.Stream], None],
        fork: Callable[[torch.cuda.Stream, torch.cuda.Stream], None],
    ):
        self.capture_stream = capture_stream
        self._capture_info = capture_info
        self._join = join
        self._fork = fork
        self._capture_id: int | None = None  # asked of CUDA when a hook first needs it
        self._segment_number = 0
        self._streams: dict[int, torch.cuda.Stream] = {}  # every side stream seen this segment
        self._open: set[int] = set()  # forked, with work not yet joined
        self._joined_at: dict[int, tuple[int, ...]] = {}  # dependencies when last joined
        self._carry: list[torch.cuda.Stream] = []  # open at the last segment end: fork again
        # What each event recorded into a segment stands for (None: re-recorded outside the
        # capture since); the events are held to the capture's end (:meth:`capture_ended`).
        self._recorded_on: dict[torch.cuda.Event, tuple[torch.cuda.Stream, int, CaptureInfo] | None] = {}

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
        if info.status is not CaptureStatus.ACTIVE or info.capture_id != self.capture_id:
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
        if info.status is CaptureStatus.ACTIVE and info.capture_id == self.capture_id:
            self._recorded_on[event] = (stream, self._segment_number, info)
        elif event in self._recorded_on:
            self._recorded_on[event] = None

    def capture_ended(self) -> None:
        """Let go of the events recorded into the capture's segments, now that none captures.
        Held until here, no such event is destroyed while a later segment captures on its
        stream, wherever the user's code drops it (a break included): ``torch.cuda.graph``'s
        users destroy an event recorded in a capture only once no capture of its stream runs."""
        self._recorded_on.clear()

    def recorded_in_earlier_segment(self, event: torch.cuda.Event) -> bool:
        """The event belongs to a capture that has ended: CUDA cannot wait on it
        inside this one, and by replay order its work is already done."""
        entry = self._recorded_on.get(event)
        return entry is not None and entry[1] != self._segment_number

    def waited_on_earlier_segment(self, stream: torch.cuda.Stream) -> None:
        """Stand-in for waiting on an event of an earlier segment: that work has
        finished before this segment starts, so ``stream`` only needs to follow
        the capture stream."""
        if _stream_id(stream) != _stream_id(self.capture_stream):
            self._fork(stream, self.capture_stream)
            self._note_fork(stream)

    def event_waited(self, event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        entry = self._recorded_on.get(event)
        if entry is not None:
            source, _segment, info = entry
            self.stream_waited(stream, source, info)

    def _note_fork(self, stream: torch.cuda.Stream) -> None:
        sid = _stream_id(stream)
        self._streams[sid] = stream
        self._open.add(sid)
        self._joined_at.pop(sid, None)

    @property
    def open_streams(self) -> tuple[int, ...]:
        return tuple(sorted(self._open))


# -- hooks ----------------------------------------------------------------------

_lock = threading.Lock()
_users = 0
_originals: dict[tuple[type, str], Callable] = {}
_quiet = threading.local()  # set while a hooked wait_stream runs its event calls


def _tracker() -> ForkJoinTracker | None:
    capture = context.current()
    if capture is None or not capture.segment_open or getattr(_quiet, "active", False):
        return None  # outside a capture, or inside an eager break: plain torch semantics
    return capture.tracker


def _hooked_wait_stream(self: torch.cuda.Stream, stream: torch.cuda.Stream) -> None:
    tracker = _tracker()
    if tracker is None:
        return _originals[(torch.cuda.Stream, "wait_stream")](self, stream)
    original_wait_stream(self, stream)
    tracker.stream_waited(self, stream)


def _event_hook(name: str) -> Callable:
    """Decorator: ``tracked(original, event, stream, tracker)`` as the hook of ``Event.<name>``,
    which calls torch's own method outside a capture's segments."""

    def make(tracked: Callable[[Callable, torch.cuda.Event, torch.cuda.Stream, ForkJoinTracker], None]) -> Callable:
        def hooked(self: torch.cuda.Event, stream: torch.cuda.Stream | None = None) -> None:
            original = _originals[(torch.cuda.Event, name)]
            tracker = _tracker()
            if tracker is None:
                return original(self, stream)
            tracked(original, self, torch.cuda.current_stream() if stream is None else stream, tracker)

        return hooked

    return make


@_event_hook("record")
def _hooked_event_record(original: Callable, event: torch.cuda.Event, stream: torch.cuda.Stream, tracker: ForkJoinTracker) -> None:
    original(event, stream)
    tracker.event_recorded(event, stream)


@_event_hook("wait")
def _hooked_event_wait(original: Callable, event: torch.cuda.Event, stream: torch.cuda.Stream, tracker: ForkJoinTracker) -> None:
    if tracker.recorded_in_earlier_segment(event):
        tracker.waited_on_earlier_segment(stream)
        return
    original(event, stream)
    tracker.event_waited(event, stream)


_HOOKS = {
    (torch.cuda.Stream, "wait_stream"): _hooked_wait_stream,
    (torch.cuda.Event, "record"): _hooked_event_record,
    (torch.cuda.Event, "wait"): _hooked_event_wait,
}


def install_hooks() -> None:
    """Install the hooks if this is the first active capture in the process."""
    global _users
    with _lock:
        if _users == 0:
            for (cls, name), hook in _HOOKS.items():
                _originals[(cls, name)] = cls.__dict__[name]
                setattr(cls, name, hook)
        _users += 1


def remove_hooks() -> None:
    """Put torch's methods back once the last active capture has ended."""
    global _users
    with _lock:
        _users -= 1
        if _users == 0:
            for (cls, name), original in _originals.items():
                setattr(cls, name, original)
            # _originals stays filled: a hook another thread entered just before this
            # removal still finds the method it calls (the hooks read it without the lock).


def original_wait_stream(waiter: torch.cuda.Stream, source: torch.cuda.Stream) -> None:
    """``waiter.wait_stream(source)`` with no bookkeeping by the hooks (torch
    implements it with an event record and wait, which are hooked too)."""
    _quiet.active = True
    try:
        _originals.get((torch.cuda.Stream, "wait_stream"), torch.cuda.Stream.wait_stream)(waiter, source)
    finally:
        _quiet.active = False
