"""What each event recorded during a capture stands for: work of a segment, or of a break.

A wait on such an event from the other side of a segment boundary is one CUDA
refuses; knowing where the event was recorded lets the fork/join tracker
order the wait another way (:mod:`breakgraph.recording.streams`,
:mod:`breakgraph.recording.break_watch`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from breakgraph_bindings import CaptureInfo
from breakgraph.recording.break_ordering import BreakOrdering


class SegmentRecord(NamedTuple):
    """An event recorded into segment number ``segment``, on ``stream``, as of ``info``."""

    stream: torch.cuda.Stream
    segment: int
    info: CaptureInfo


class BreakRecord(NamedTuple):
    """An event recorded on ``stream`` while a break ran, whose replay keeps ``ordering``."""

    stream: torch.cuda.Stream
    ordering: BreakOrdering


class EventRecords:
    """The events recorded into one capture's segments and breaks, each with what it
    stands for (None once the user's code records it outside them), held to the capture's
    end (:meth:`clear`): ``torch.cuda.graph``'s users destroy an event recorded in a
    capture only once no capture of its stream runs, and the user's code may drop one
    anywhere, a break included."""

    def __init__(self) -> None:
        self._stands_for: dict[torch.cuda.Event, SegmentRecord | BreakRecord | None] = {}
        self._rerecorded: set[torch.cuda.Event] = set()  # segments' events a break's watch recorded again

    def get(self, event: torch.cuda.Event) -> SegmentRecord | BreakRecord | None:
        return self._stands_for.get(event)

    def of_segment(self, event: torch.cuda.Event) -> SegmentRecord | None:
        """The segment record of ``event``, if a segment recorded it last."""
        entry = self._stands_for.get(event)
        return entry if isinstance(entry, SegmentRecord) else None

    def recorded(self, event: torch.cuda.Event, record: SegmentRecord | BreakRecord) -> None:
        self._stands_for[event] = record
        self._rerecorded.discard(event)  # its latest record is no longer the one recorded again

    def recorded_outside(self, event: torch.cuda.Event) -> None:
        """``event`` was recorded outside the capture's segments and breaks: it stands for
        nothing of the capture's."""
        if event in self._stands_for:
            self._stands_for[event] = None

    def forget_break(self, ordering: BreakOrdering) -> None:
        """The break that keeps ``ordering`` was discarded: its events stand for nothing."""
        for event, entry in self._stands_for.items():
            if isinstance(entry, BreakRecord) and entry.ordering is ordering:
                self._stands_for[event] = None

    def rerecorded(self, event: torch.cuda.Event) -> bool:
        """Whether ``event``, a segment's, was recorded again outside the capture since that
        segment recorded it (:meth:`mark_rerecorded`)."""
        return event in self._rerecorded

    def mark_rerecorded(self, event: torch.cuda.Event) -> None:
        self._rerecorded.add(event)

    def clear(self) -> None:
        """Let go of the events, now that no segment of the capture captures."""
        self._stands_for.clear()
        self._rerecorded.clear()
