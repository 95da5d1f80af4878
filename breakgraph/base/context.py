"""Which capture, if any, is active on this thread, and what the rest of the engine may ask of it.

State lives in a ``ContextVar`` so every thread (and asyncio task) sees only
its own capture. Autograd's device threads are kept out of the picture by
running captures with autograd multithreading off, so backward passes, and
the breaks inside them, run on the capturing thread.

:class:`ActiveCapture` is the whole interface that ``eager``, ``dispatch`` and
``streams`` use; they never name the class that implements it.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar, Token
from typing import Any, Callable, ContextManager, Optional, Protocol


class ActiveCapture(Protocol):
    segment_open: bool
    """True while a graph segment is recording; False inside an eager break."""

    tracker: Any
    """The side-stream fork/join tracker of this capture (:class:`breakgraph.recording.streams.ForkJoinTracker`)."""

    def run_break(
        self,
        function: Callable,
        args: tuple,
        kwargs: dict,
        name: str,
        *,
        inline: Callable | bool | None = None,
        stub: Callable | None = None,
    ) -> Any:
        """End the open segment, run ``function`` (or its ``stub``) eagerly and record it,
        begin the next segment; in a full-graph capture, record ``inline`` (a capturable
        variant, or True for ``function`` itself) inside the open segment instead. ``name``
        names the break in segment names and errors."""

    def random_op(self, op: Callable, call: Callable, args: tuple, kwargs: dict) -> Any:
        """Run a random op the op watch met inside a segment: in a segment torch records
        (``call`` runs ``op`` below the watch), or as an eager break."""

    branches_on_device: bool
    """Whether ``cond`` and ``while_loop`` become conditional nodes (False: debug mode runs
    each as an eager break)."""

    body_depth: int
    """How many conditional bodies are being captured, one inside the other."""

    def conditional_node(self, what: str) -> None:
        """A conditional node goes into the open segment: make it one recorded through
        cuda.bindings (a segment torch records, after a random op, ends at ``what`` and one
        begins), and note that it holds one."""

    def inside_body(self) -> ContextManager:
        """While a conditional body is captured: breaks are refused (a body is one graph)."""

    def body_failed(self, what: str) -> None:
        """A conditional body failed, ``what`` says how: its node is half built, so the capture
        cannot end in a graph, even where the caller catches the error and goes on."""


_active: ContextVar[Optional[ActiveCapture]] = ContextVar("breakgraph_capture", default=None)

current = _active.get


def activate(capture: ActiveCapture) -> Token:
    """Make ``capture`` this thread's capture; returns the token for :func:`deactivate`."""
    return _active.set(capture)


def deactivate(token: Token) -> None:
    _active.reset(token)


def is_capturing() -> bool:
    """True inside an active breakable capture (its graph parts and its eager
    breaks), False outside it and during replay."""
    return _active.get() is not None


_full_graph_warmup: ContextVar[bool] = ContextVar("breakgraph_full_graph_warmup", default=False)


def warming_up_full_graph() -> bool:
    """True while :func:`full_graph_warmup` is active in this context."""
    return _full_graph_warmup.get()


@contextlib.contextmanager
def full_graph_warmup():
    """Eager warm-up runs before a full-graph capture: breaks run their capturable variants, so
    what the capture will record (a kernel library's first-call set-up, say) is set up outside it."""
    token = _full_graph_warmup.set(True)
    try:
        yield
    finally:
        _full_graph_warmup.reset(token)


_op_watch_skipped: ContextVar[bool] = ContextVar("breakgraph_op_watch_skipped", default=False)


def op_watch_skipped() -> bool:
    """True while :func:`skip_op_watch` is active in this context."""
    return _op_watch_skipped.get()


@contextlib.contextmanager
def skip_op_watch():
    """A capture begun here does not watch its ops for random ones (the watch costs a
    Python call per op): for a caller that saw its function draw none when it ran
    eagerly, and that captures again with the watch if a random op is refused."""
    token = _op_watch_skipped.set(True)
    try:
        yield
    finally:
        _op_watch_skipped.reset(token)
