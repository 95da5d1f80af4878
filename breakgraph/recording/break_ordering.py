"""Events that cross a break, and the ordering a break's replay keeps for them.

CUDA refuses both ways an event can cross a segment boundary: a capturing
stream cannot wait on an event recorded outside its capture, and a stream
outside a capture cannot wait on one recorded inside it (nor can anything at
replay, as the graph never records it again). The stream hooks route such
waits here at capture, and the break's replay keeps the order they asked for:

- **Recorded in a break, waited on in a later segment.** The segment waits on
  an event of breakgraph's, recorded on the break's stream right after every
  replay of the break: an event-wait node of the graph, where the wait was, so
  the graph's work ahead of the wait still overlaps the break's stream.
- **Recorded in a segment, waited on in a later break.** Before every replay
  of the break, the waiting stream waits on the replay stream's work so far:
  the graphs launched before the break, which hold the work the event stood for.
  So does a stream that waits in a break on a side stream whose work a segment
  captured (``wait_stream``). **Synchronized with or queried in a later break**:
  before every replay of the break, the host waits for those graphs, whichever
  event object the break's code then holds (one the model makes anew in eager
  calls between replays included).
- **A stream a break queued work on, used by a later segment** (waited on,
  forked again, or carried across the break). The segment waits on an event
  of breakgraph's recorded on that stream after every replay of the latest
  break before it, as for an event.
- **A side stream a break queued work on, where it returns a result.** Its result
  may be that stream's work, which eager code may leave for the caller to wait on;
  but replay copies the result into the graph's buffers as the break returns. So
  the replay stream waits for that stream before the copy, and the stream waits
  for the copy after it (the result's memory may be its, free again once copied).

Work recorded on, or waited on by, the capture stream itself needs none of this:
at replay the replay stream runs the graphs and the breaks in order.
"""

from __future__ import annotations

import breakgraph_bindings as bindings
from breakgraph_bindings import StreamHandle


class BreakOrdering:
    """What one break orders across its boundaries at replay (see the module): the streams
    that follow the replay stream before it runs, the streams its result's writeback waits
    for, and the events it records after."""

    def __init__(self) -> None:
        self._followers: dict[int, StreamHandle] = {}
        self._signals: dict[int, tuple[StreamHandle, bindings.Event]] = {}
        self._ready: bindings.Event | None = None  # what the followers and the host wait on
        self._host_waits = False
        self._writeback_waits: dict[int, tuple[StreamHandle, bindings.Event]] = {}
        self._written: bindings.Event | None = None  # what those streams wait on after the writeback

    @property
    def runs_before(self) -> bool:
        """Whether it has work before the break (:meth:`before`)."""
        return bool(self._followers) or self._host_waits

    @property
    def has_signals(self) -> bool:
        return bool(self._signals)

    def follow(self, raw_stream: int) -> None:
        """Before the break replays, ``raw_stream`` waits on the replay stream's work so far."""
        self._make_ready()
        self._followers.setdefault(raw_stream, bindings.stream_handle(raw_stream))

    def wait_on_host(self) -> None:
        """Before the break replays, the host waits for the replay stream's work so far."""
        self._make_ready()
        self._host_waits = True

    def _make_ready(self) -> None:
        if self._ready is None:
            self._ready = bindings.Event()

    def signal_on(self, raw_stream: int) -> bindings.Event:
        """The event recorded on ``raw_stream`` (of the capture's device) after every replay of the break."""
        signal = self._signals.get(raw_stream)
        if signal is None:
            signal = self._signals[raw_stream] = (bindings.stream_handle(raw_stream), bindings.Event())
        return signal[1]

    @property
    def orders_writeback(self) -> bool:
        """Whether the result's writeback waits for side streams
        (:meth:`before_writeback`, :meth:`after_writeback`)."""
        return bool(self._writeback_waits)

    def write_back_after(self, raw_stream: int) -> None:
        """Write the break's result back only after the work it queued on ``raw_stream``
        (of the capture's device)."""
        if raw_stream not in self._writeback_waits:
            self._writeback_waits[raw_stream] = (bindings.stream_handle(raw_stream), bindings.Event())
            self._written = self._written or bindings.Event()

    def before_writeback(self, replay_stream: StreamHandle) -> None:
        """Make ``replay_stream`` wait for the work queued so far on those side streams."""
        for stream, done in self._writeback_waits.values():
            done.record(stream)
            bindings.wait_event(replay_stream, done)

    def after_writeback(self, replay_stream: StreamHandle) -> None:
        """Make those side streams wait for the writeback: their later work may reuse the
        memory of the result it copied."""
        self._written.record(replay_stream)
        for stream, _done in self._writeback_waits.values():
            bindings.wait_event(stream, self._written)

    def before(self, replay_stream: StreamHandle) -> None:
        """Order the followers after ``replay_stream``'s work so far, and wait for that work on
        the host where the break does (ahead of the break)."""
        self._ready.record(replay_stream)
        for follower in self._followers.values():
            bindings.wait_event(follower, self._ready)
        if self._host_waits:
            self._ready.synchronize()

    def after(self) -> None:
        """Record every signal on its stream (after the break)."""
        for stream, event in self._signals.values():
            event.record(stream)
