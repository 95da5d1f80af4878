"""Which capture, if any, is active on this thread.

State lives in a ``ContextVar`` so every thread (and asyncio task) sees only
its own capture. Autograd's device threads are kept out of the picture by
running captures with autograd multithreading off, so backward passes, and
the breaks inside them, run on the capturing thread.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from breakgraph.capture import CaptureSession

_session: ContextVar[Optional["CaptureSession"]] = ContextVar("breakgraph_capture", default=None)

current_session = _session.get


def activate(session: "CaptureSession"):
    """Make ``session`` this thread's capture; returns the token for :func:`deactivate`."""
    return _session.set(session)


def deactivate(token) -> None:
    _session.reset(token)


def is_capturing() -> bool:
    """True inside an active breakable capture (its graph parts and its eager
    breaks), False outside it and during replay."""
    return _session.get() is not None
