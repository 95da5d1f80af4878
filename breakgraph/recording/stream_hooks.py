"""The hooks on torch's ``Stream.wait_stream``, ``Event.record``, ``Event.wait``,
``Event.synchronize`` and ``Event.query`` that report forks, joins and events to the
capturing thread's fork/join tracker (:class:`breakgraph.recording.streams.ForkJoinTracker`).

They are installed when the first capture starts and removed when the last
one ends (reference-counted under a lock). The body watch's refusal of
``synchronize`` is installed over them only while a body captures, inside a
capture, so it is always removed first. Outside a capture of the calling
thread they call straight through to torch's methods; inside a segment they
report to the tracker, and inside a break to its break watch
(:class:`breakgraph.recording.break_watch.BreakWatch`), only what may cross it.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from breakgraph.base import context, runtime

_lock = threading.Lock()
_users = 0
_originals: dict[tuple[type, str], Callable] = {}
_quiet = threading.local()  # set while a hooked wait_stream runs its event calls


def _capture_here():
    """The calling thread's capture, or None outside one and inside the hooks' own calls."""
    capture = context.current()
    if capture is None or getattr(_quiet, "active", False):
        return None
    return capture


def _hooked_wait_stream(self: torch.cuda.Stream, stream: torch.cuda.Stream) -> None:
    capture = _capture_here()
    if capture is None:
        return _originals[(torch.cuda.Stream, "wait_stream")](self, stream)
    stream = runtime.as_cuda_stream(stream)
    if not capture.segment_open:
        original_wait_stream(self, stream)  # its own event crosses no boundary
        capture.tracker.breaks.stream_waited(self, stream)
    elif not capture.tracker.waited_on_uncaptured_stream(self, stream):
        original_wait_stream(self, stream)
        capture.tracker.stream_waited(self, stream)


def _event_hook(name: str) -> Callable:
    """Decorator: ``tracked(original, event, stream, capture)`` as the hook of ``Event.<name>``,
    which calls torch's own method outside a capture."""

    def make(tracked: Callable[[Callable, torch.cuda.Event, torch.cuda.Stream, context.ActiveCapture], None]) -> Callable:
        def hooked(self: torch.cuda.Event, stream: torch.cuda.Stream | None = None) -> None:
            original = _originals[(torch.cuda.Event, name)]
            capture = _capture_here()
            if capture is None:
                return original(self, stream)
            tracked(original, self, torch.cuda.current_stream() if stream is None else runtime.as_cuda_stream(stream), capture)

        return hooked

    return make


@_event_hook("record")
def _hooked_event_record(original: Callable, event: torch.cuda.Event, stream: torch.cuda.Stream, capture: context.ActiveCapture) -> None:
    original(event, stream)
    if capture.segment_open:
        capture.tracker.event_recorded(event, stream)
    else:
        capture.tracker.breaks.event_recorded(event, stream)


@_event_hook("wait")
def _hooked_event_wait(original: Callable, event: torch.cuda.Event, stream: torch.cuda.Stream, capture: context.ActiveCapture) -> None:
    tracker = capture.tracker
    if not capture.segment_open:
        if not tracker.breaks.event_waited(event, stream):
            original(event, stream)
    elif not tracker.waited_in_segment(event, stream):
        original(event, stream)
        tracker.event_waited(event, stream)


def _host_wait_hook(name: str) -> Callable:
    """The hook of ``Event.<name>`` (``synchronize``, ``query``): in a break, the break watch
    first makes a segment's event one the host can wait on, at capture and at replay."""

    def hooked(self: torch.cuda.Event):
        capture = _capture_here()
        if capture is not None and not capture.segment_open:
            capture.tracker.breaks.event_synchronized(self)
        return _originals[(torch.cuda.Event, name)](self)

    return hooked


_HOOKS = {
    (torch.cuda.Stream, "wait_stream"): _hooked_wait_stream,
    (torch.cuda.Event, "record"): _hooked_event_record,
    (torch.cuda.Event, "wait"): _hooked_event_wait,
    (torch.cuda.Event, "synchronize"): _host_wait_hook("synchronize"),
    (torch.cuda.Event, "query"): _host_wait_hook("query"),
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


def original_record(event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
    """``event.record(stream)`` with no bookkeeping by the hooks."""
    _originals.get((torch.cuda.Event, "record"), torch.cuda.Event.record)(event, stream)


def original_wait_stream(waiter: torch.cuda.Stream, source: torch.cuda.Stream) -> None:
    """``waiter.wait_stream(source)`` with no bookkeeping by the hooks (torch
    implements it with an event record and wait, which are hooked too)."""
    _quiet.active = True
    try:
        _originals.get((torch.cuda.Stream, "wait_stream"), torch.cuda.Stream.wait_stream)(waiter, source)
    finally:
        _quiet.active = False
