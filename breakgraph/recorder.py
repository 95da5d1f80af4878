"""The capture state machine: one active capture, its segment boundaries and its breaks.

:func:`start` opens everything a capture needs (the pool routing, stream
hooks, the paused cycle collector, the active-capture context, the first
segment) as one scope; :meth:`Recorder.finish` closes it and hands back the
segments, :meth:`Recorder.abort` closes it and destroys them. The recorder is
what ``eager``, ``dispatch`` and ``streams`` see through
:class:`breakgraph.context.ActiveCapture`.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

import breakgraph_bindings as bindings
from breakgraph import context, rng, runtime, streams
from breakgraph.breaks import record_break, warn_kept_allocations
from breakgraph.dispatch import CaptureDispatchMode, UncapturableOpError, is_capture_invalidated, is_capture_violation
from breakgraph.naming import function_name
from breakgraph.options import CaptureOptions
from breakgraph.pool import PoolUsage, captures_running
from breakgraph.segments import GraphSegment, Segment, instantiate

_warned_uncooperative = False

_ARMING_WAIT_S = 60.0
"""How long a capture's first random op waits for another capture to release the generators."""


def _warn_uncooperative() -> None:
    global _warned_uncooperative
    if not _warned_uncooperative:
        _warned_uncooperative = True
        warnings.warn(
            f"breakgraph: random ops (dropout, randn, ...) run as eager breaks on torch {torch.__version__}. "
            "From torch 2.12 on, only a capture that torch itself begins can draw random numbers inside a "
            "CUDA graph, and breakgraph captures through cuda.bindings. Every replay still draws fresh "
            "numbers, at the cost of one break per random op. Pass random_ops='break' to choose this and "
            "silence this warning; torch 2.11 captures random ops into the graph.",
            stacklevel=4,
        )


@dataclass(frozen=True)
class Recording:
    """What a finished capture hands its graph: the segments, the device, and the call that
    refills the armed generators before each replay (None when no segment drew random numbers)."""

    segments: tuple[Segment, ...]
    device: torch.device
    refill_generators: Callable[[], None] | None


class Recorder:
    """The state of one active capture (one thread, one capture stream)."""

    def __init__(self, pool, stream: torch.cuda.Stream, options: CaptureOptions, record_addresses: bool):
        self.pool = pool
        self.stream = stream
        self.options = options
        self.mode = options.capture_error_mode
        self.inline = options.breaks == "inline"
        self.barrier = options.barrier_fn
        self.record_addresses = record_addresses
        self.random: rng.ArmedGenerators | None = None
        self.arm_when_free = False  # another capture held the generators at the start
        self.segments: list[Segment] = []
        self.segment_open = False
        self.tracker = streams.ForkJoinTracker(
            stream,
            bindings.capture_info,
            join=streams.original_wait_stream,
            fork=streams.original_wait_stream,
        )
        self._previous = "start"  # what the next graph segment follows, for its name
        self._scope = contextlib.ExitStack()

    # -- segment boundaries ----------------------------------------------------------
    def begin_segment(self) -> None:
        bindings.begin_capture(self.stream, self.mode)
        self.segment_open = True
        if self.random is not None:
            self.random.point_at_armed_states()
        self.tracker.segment_begun()

    def end_segment(self, following: str) -> None:
        """End the open segment and keep its graph: :meth:`finish` instantiates them all."""
        side_streams = self.tracker.segment_ending()
        if self.random is not None:
            self.random.point_at_plain_states()
        graph = bindings.end_capture(self.stream)
        self.segment_open = False
        name = f"graph {self._previous} -> {following}"
        self.segments.append(GraphSegment(len(self.segments), name, graph, None, 0, side_streams))

    def _instantiated(self) -> list[Segment]:
        """The segments in replay order, numbered again: graphs that captured nothing are
        destroyed, the others instantiated. Done once the capture has ended: CUDA counts and
        instantiates graphs back to back faster than one at each break (docs/performance.md)."""
        kept = []
        for segment in self.segments:
            if segment.kind == "graph":
                segment.num_nodes = segment.graph.num_nodes
                if segment.num_nodes == 0:
                    segment.release()
                    continue
                segment.executable, segment.executable_bytes = instantiate(segment.graph, self.stream, self.options.measure_memory)
            segment.index = len(kept)
            kept.append(segment)
        return kept

    # -- breaks ------------------------------------------------------------------------
    def run_break(
        self,
        function: Callable,
        args: tuple,
        kwargs: dict,
        name: str | None = None,
        *,
        inline: Callable | bool | None = None,
        stub: Callable | None = None,
    ) -> Any:
        """End the segment, run ``function`` (its ``stub`` if it has one) eagerly and record
        it, begin the next segment. In a full-graph capture, record ``inline`` in the open
        segment instead."""
        name = name or function_name(function)
        if self.inline:
            return self._run_inline(name, function, inline, args, kwargs)
        call = f"{name}()"
        self.end_segment(following=call)
        if self.barrier is not None:
            self.barrier()
        before = None
        if self.record_addresses:  # debug mode also watches what the break allocates
            before, saved = PoolUsage.of(self.pool), []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                result = (stub or function)(*args, **kwargs)
            after = PoolUsage.of(self.pool)
            warn_kept_allocations(name, before.allocated_blocks(), after.allocated_blocks(), (result, saved))
        else:
            result = (stub or function)(*args, **kwargs)
        self.segments.append(record_break(len(self.segments), name, function, args, kwargs, result, before))
        self._previous = call
        self.begin_segment()
        return result

    def random_op(self, op: Callable, args: tuple, kwargs: dict) -> Any:
        """A random op the op watch met inside a segment: captured from the armed generators
        (armed now if another capture held them at the start), or else an eager break."""
        if self.arm_when_free:
            self._arm_between_segments(str(op))
        if self.random is not None:
            return op(*args, **kwargs)
        return self.run_break(op, args, kwargs, name=f"random {op}")

    def _arm_between_segments(self, what: str) -> None:
        """Arm the generators for the rest of the capture once the capture that held them
        at the start releases them: between two segments, so no capture of ours is open.

        A full graph cannot split for that; a capture with ``barrier_fn`` splits but does
        not wait (its peers may be waiting for it at their barrier).
        """
        self.arm_when_free = False
        fixes = (
            "on torch 2.11 a generator serves one capture at a time. Let the other capture end first, "
            "capture this one with random_ops='break' (each random op an eager break), or move the op "
            "into an @breakgraph.eager_on_graph function."
        )
        if self.inline:
            raise UncapturableOpError(
                f"{what} draws random numbers, but another capture holds the CUDA generator armed, and a "
                f"full-graph capture cannot split to wait for it: {fixes}"
            )
        self.end_segment(following="arming generators")
        wait = _ARMING_WAIT_S if self.barrier is None else 0.0
        busy = None
        try:
            self.random = rng.ArmedGenerators.off_thread(self.stream.device, self.options.generators, self.stream, wait=wait)
        except rng.GeneratorBusy as error:
            busy = error
        self._previous = "arming generators"
        self.begin_segment()  # the capture stays whole, also when the caller goes on after the error
        if busy is not None:
            peers = "" if wait else " (a capture with barrier_fn does not wait: its peers may be waiting for it)"
            raise UncapturableOpError(f"{what} draws random numbers, but {busy}{peers}: {fixes}")

    def _run_inline(self, name: str, function: Callable, inline, args: tuple, kwargs: dict) -> Any:
        fix = "capture with breaks='eager' (the breakable mode) for this key"
        if inline is None:
            raise UncapturableOpError(
                f"{name}() has no capturable variant, so a full-graph capture (breaks='inline') cannot record "
                f"it: breakgraph cannot tell whether it reads host values a graph would freeze. Give it one "
                f"(@{name}.inline, or @eager_on_graph(inline=True) if it is capturable as it is), or {fix}."
            )
        try:
            return (function if inline is True else inline)(*args, **kwargs)
        except RuntimeError as error:
            if not is_capture_violation(error) or is_capture_invalidated(error):
                raise
            raise UncapturableOpError(f"{name}() cannot be captured inline ({error}); {fix}.") from error

    # -- the whole capture -----------------------------------------------------------------
    def finish(self) -> Recording:
        """End the last segment and close the capture's scope; the recording is the caller's now."""
        try:
            drawn = self.random is not None and self.random.drawn()  # asked while the last segment records
            self.end_segment(following="end")
            if self.barrier is not None:
                self.barrier()
            random, self.random = self.random, None
            refill = random.disarm(keep=drawn) if random is not None else None
            segments = self._instantiated()
        except BaseException:
            self.abort()
            raise
        self._scope.close()
        self.segments = []
        return Recording(tuple(segments), self.stream.device, refill)

    def abort(self) -> None:
        """End a half-done capture, destroy what it made and close its scope; never raises
        (the error that caused the abort is the one to report)."""
        began, self.segment_open = self.segment_open, False
        if began:  # only a capture this recorder began: another may be under way on the same stream
            bindings.discard_capture(self.stream)
        for segment in self.segments:
            segment.release()
        self.segments = []
        if self.random is not None:
            random, self.random = self.random, None
            with contextlib.suppress(Exception):
                random.disarm(keep=False)
        bindings.clear_last_error()
        self._scope.close()


def start(pool, stream: torch.cuda.Stream, options: CaptureOptions, record_addresses: bool) -> Recorder:
    """Open a capture on ``stream`` (already the current stream) into ``pool``: arm the
    generators, route allocations to the pool, pause the cycle collector, hook
    ``wait_stream``, make the recorder this thread's active capture, and begin the
    first segment."""
    recorder = Recorder(pool, stream, options, record_addresses)
    scope = recorder._scope
    random_ops = options.random_ops
    watch = random_ops == "break"
    try:
        scope.enter_context(runtime.claim_capture_stream(stream.device, stream))
        # Before pool routing, so it is released after the routing and the CUDA capture
        # have ended: only then may pools die and dead pools' memory be freed.
        scope.enter_context(captures_running())
        if random_ops == "graph":
            if not rng.cooperative():
                _warn_uncooperative()
                watch = True
            else:
                try:  # before pool routing: torch keeps the generators' device state outside our pool
                    recorder.random = rng.ArmedGenerators(stream.device, options.generators, stream)
                except rng.GeneratorBusy:  # held by another capture: the first random op waits for it
                    watch = recorder.arm_when_free = True
        scope.enter_context(torch.cuda.use_mem_pool(pool, stream.device))
        # Backward passes run on this thread, so their breaks and allocations are ours.
        scope.enter_context(torch.autograd.set_multithreading_enabled(False))
        streams.install_hooks()
        scope.callback(streams.remove_hooks)
        scope.callback(context.deactivate, context.activate(recorder))
        if watch:
            scope.enter_context(CaptureDispatchMode(recorder))
        recorder.begin_segment()
    except BaseException:
        recorder.abort()
        raise
    return recorder
