"""The capture state machine: one active capture, its segment boundaries and its breaks.

:func:`start` makes a recorder and opens (:meth:`Recorder.open`) everything a
capture needs (the pool routing, stream hooks, the paused cycle collector, the
active-capture context, the first segment) as one scope; :meth:`Recorder.finish`
closes it and hands back the segments, :meth:`Recorder.abort` closes it and
destroys them. The recorder is what ``eager``, ``dispatch`` and ``streams`` see
through :class:`breakgraph.base.context.ActiveCapture`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

import breakgraph_bindings as bindings
from breakgraph.base import context, runtime
from breakgraph.recording import rng, stream_hooks, streams
from breakgraph.recording.breaks import record_break, run_eagerly, run_inline
from breakgraph.recording.dispatch import BarrierBeforeCollectives, UncapturableOpError
from breakgraph.recording.op_watch import watch_ops
from breakgraph.base.options import CaptureOptions
from breakgraph.base.pool import captures_running
from breakgraph.base.ranks import PeerBarrier
from breakgraph.recording.segments import GraphSegment, Segment, TorchGraphSegment

_GENERATOR_WAIT_S = 60.0
"""How long a random op waits for another capture's segment to let the generators go."""


@dataclass(frozen=True)
class Recording:
    """What a finished capture hands its graph: the segments and the device."""

    segments: tuple[Segment, ...]
    device: torch.device


class Recorder:
    """The state of one active capture (one thread, one capture stream).

    A segment is recorded through cuda.bindings until it meets a random op (the
    op watch reports it: :meth:`random_op`); from that op on, up to the next break
    or the end, torch records it (:class:`breakgraph.recording.rng.TorchCapture`), since only
    a capture torch began can draw random numbers that each replay draws afresh.
    """

    def __init__(self, pool: torch.cuda.MemPool, stream: torch.cuda.Stream, options: CaptureOptions, record_addresses: bool):
        self.pool = pool
        self.stream = stream
        self._handle = bindings.stream_handle(stream)  # made once: a break ends and begins a capture on it
        self.options = options
        self.mode = options.capture_error_mode
        self.inline = options.breaks == "inline"
        self.barrier = options.barrier_fn
        self.peers = self.barrier if isinstance(self.barrier, PeerBarrier) else None  # a runner's ranks
        self.record_addresses = record_addresses
        self._checked_pool = pool if record_addresses else None  # debug mode: what each break keeps in it is checked
        self.torch_capture: rng.TorchCapture | None = None  # the open segment, when torch records it
        self.branches_on_device = not record_addresses  # debug mode runs cond and while_loop as breaks
        self.body_depth = 0
        self._conditional_nodes = 0  # in the open segment, outside bodies
        self._failed_body: str | None = None  # a half-built conditional node: the capture cannot finish
        self.segments: list[Segment] = []
        self.segment_open = False
        self.tracker = streams.ForkJoinTracker(
            stream,
            bindings.capture_info,
            join=stream_hooks.original_wait_stream,
            fork=stream_hooks.original_wait_stream,
        )
        self._routing = None  # this thread's allocations routed to the pool, between torch's segments
        self._previous = "start"  # what the next graph segment follows, for its name
        self._scope = contextlib.ExitStack()

    # -- pool routing ------------------------------------------------------------------
    def route_to_pool(self) -> None:
        """Route this thread's allocations to the pool (torch routes its own segments')."""
        if self._routing is None:
            routing = torch.cuda.use_mem_pool(self.pool, self.stream.device)
            routing.__enter__()
            self._routing = routing

    def stop_routing(self) -> None:
        routing, self._routing = self._routing, None
        if routing is not None:
            routing.__exit__(None, None, None)

    # -- segment boundaries ----------------------------------------------------------
    def begin_segment(self) -> None:
        bindings.begin_capture(self._handle, self.mode)
        self._segment_begun()

    def _segment_begun(self) -> None:
        """A segment's capture is open, ours or torch's: the side streams fork into it again."""
        self.segment_open = True
        self.tracker.segment_begun()

    def end_segment(self, following: str) -> None:
        """End the open segment and keep its graph: :meth:`finish` instantiates them all."""
        side_streams = self.tracker.segment_ending()
        name = f"graph {self._previous} -> {following}"
        index = len(self.segments)
        graph = self._end_capture(following)
        if self.torch_capture is not None:
            self.torch_capture, self.segment_open = None, False
            self.route_to_pool()
            self.segments.append(TorchGraphSegment(index, name, rng.borrowed_graph(graph), graph, side_streams=side_streams))
        else:
            self.segment_open = False
            conditional_nodes, self._conditional_nodes = self._conditional_nodes, 0
            self.segments.append(GraphSegment(index, name, graph, None, side_streams=side_streams, conditional_nodes=conditional_nodes))

    def _end_capture(self, following: str):
        """End the open segment's CUDA capture, ours or torch's, and return its graph. On failure
        :meth:`abort` ends what is left; a fork CUDA found unjoined is named at ``following``."""
        try:
            return self.torch_capture.end() if self.torch_capture is not None else bindings.end_capture(self._handle)
        except RuntimeError as error:
            unjoined = streams.unseen_fork(error, following)
            if unjoined is not None:
                raise unjoined from error
            raise

    def _instantiated(self) -> list[Segment]:
        """The segments in replay order, numbered again: graphs that captured nothing are
        destroyed, a segment that a random op ended is folded into the one torch recorded from
        that op on, and the rest are instantiated. Done once the capture has ended: CUDA counts
        and instantiates graphs back to back faster than one at each break (docs/performance.md)."""
        kept: list[Segment] = []
        for segment in self.segments:
            if not segment.captured_anything():
                segment.release()
                continue
            if kept and segment.take_in(kept[-1]):
                kept.pop()
            segment.index = len(kept)
            kept.append(segment)
        stream, measure = self._handle, self.options.measure_memory
        for segment in kept:
            segment.ready(stream, measure)
        return kept

    # -- breaks ------------------------------------------------------------------------
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
        """End the segment, run ``function`` (its ``stub`` if it has one) eagerly and record
        it, begin the next segment. In a full-graph capture, record ``inline`` in the open
        segment instead. ``name`` names the break in segment names and errors."""
        if self.body_depth:
            raise UncapturableOpError(
                f"{name}() is an eager break inside the body of a breakgraph.cond or while_loop, which the GPU "
                "runs as one graph, with no stop for the host: move the break out of the branch, or make the "
                "whole cond or while_loop an eager break (call it from an @breakgraph.eager_on_graph function)."
            )
        if self.inline:
            return run_inline(name, function, inline, args, kwargs)
        call = f"{name}()"
        self.end_segment(following=call)
        if self.barrier is not None and self.peers is None:
            self.barrier()
        run = stub or function
        self.tracker.break_begun()
        try:
            if self.barrier is None or (self.peers is not None and self.peers.is_quiet(function)):
                result, before = run_eagerly(name, run, args, kwargs, self._checked_pool)
            else:  # the barrier before each collective the break issues
                with BarrierBeforeCollectives(self.barrier) as watch:
                    result, before = run_eagerly(name, run, args, kwargs, self._checked_pool)
                if self.peers is not None and not watch.collectives:
                    self.peers.found_quiet(function)  # a runner's peers learn which breaks issue none
            segment = record_break(len(self.segments), name, function, args, kwargs, result, before)
            self.tracker.break_ended(segment)
            self.segments.append(segment)
        except BaseException:
            self.tracker.break_discarded()
            raise
        finally:  # also when the break raised: the capture stays whole for a caller that goes on
            self._previous = call
            self.begin_segment()
        return result

    def random_op(self, op: Callable, call: Callable, args: tuple, kwargs: dict) -> Any:
        """A random op the op watch met inside a segment: an eager break with
        ``random_ops="break"``; otherwise recorded by torch (``call`` runs it below the
        watch), the segment going on in a torch capture from this op if it was not in one already."""
        if self.options.random_ops == "break":
            return self.run_break(op, args, kwargs, f"random {op}")
        if self.torch_capture is None:
            self._go_on_in_torch_capture(str(op))
        return call(*args, **kwargs)

    def _go_on_in_torch_capture(self, what: str) -> None:
        """End the segment at ``what``, the first random op in it, and go on in one that torch
        records: between the two no capture of ours is open, so waiting for another
        capture's segment to let the generators go is safe. A capture with ``barrier_fn``
        does not wait (its peers may be waiting for it at their barrier)."""
        self.end_segment(following=what)
        self._previous = what
        wait = _GENERATOR_WAIT_S if self.barrier is None else 0.0
        self.stop_routing()
        try:
            mode = self.mode.name.lower()  # as torch spells it
            self.torch_capture = rng.TorchCapture(self.pool, self.stream, mode, self.options.generators, wait)
        except rng.GeneratorBusy as busy:
            self.route_to_pool()
            self.begin_segment()  # the capture stays whole, also when the caller goes on after the error
            peers = "" if wait else " (a capture with barrier_fn does not wait: its peers may be waiting for it)"
            raise UncapturableOpError(
                f"{what} draws random numbers, but {busy}{peers}. A generator serves one capture's segment at a "
                "time: let the other capture end first, capture this one with random_ops='break' (each random "
                "op an eager break), or move the op into an @breakgraph.eager_on_graph function."
            ) from busy
        except BaseException:
            self.route_to_pool()
            raise
        self._segment_begun()

    def conditional_node(self, what: str) -> None:
        """A conditional node goes into the open segment. They go only into segments recorded
        through cuda.bindings: one torch records (it met a random op) ends at ``what``, and
        such a segment begins."""
        if self.torch_capture is not None:
            self.end_segment(following=what)
            self._previous = what
            self.begin_segment()
        self._conditional_nodes += self.body_depth == 0

    def body_failed(self, what: str) -> None:
        """Refuse to finish the capture: a conditional node in it is half built."""
        self._failed_body = self._failed_body or what

    @contextlib.contextmanager
    def inside_body(self):
        """While a conditional body is captured, :meth:`run_break` refuses breaks."""
        self.body_depth += 1
        try:
            yield
        finally:
            self.body_depth -= 1

    # -- the whole capture -----------------------------------------------------------------
    def open(self) -> None:
        """Open the capture as one scope: route allocations to the pool, pause the cycle
        collector, hook ``wait_stream``, make this recorder the thread's active capture, watch
        the ops where random ones may come, and begin the first segment."""
        scope, random_ops = self._scope, self.options.random_ops
        watch = random_ops == "break" or (random_ops == "graph" and not context.op_watch_skipped())
        try:
            scope.enter_context(runtime.claim_capture_stream(self.stream.device, self.stream))
            # Before pool routing, so it is released after the routing and the CUDA capture
            # have ended: only then may pools die and dead pools' memory be freed.
            scope.enter_context(captures_running())
            self.route_to_pool()
            scope.callback(self.stop_routing)
            # Backward passes run on this thread, so their breaks and allocations are ours.
            scope.enter_context(torch.autograd.set_multithreading_enabled(False))
            stream_hooks.install_hooks()
            scope.callback(stream_hooks.remove_hooks)
            scope.callback(self.tracker.capture_ended)  # after the last segment's capture has ended
            scope.callback(context.deactivate, context.activate(self))
            if watch:
                scope.enter_context(watch_ops(self))
            self.begin_segment()
        except BaseException:
            self.abort()
            raise

    def finish(self) -> Recording:
        """End the last segment and close the capture's scope; the recording is the caller's now."""
        try:
            if self._failed_body is not None:
                raise UncapturableOpError(
                    f"the capture cannot end in a graph: {self._failed_body}, which left its conditional node half "
                    "built. Fix the error and capture again."
                )
            self.end_segment(following="end")
            if self.barrier is not None and self.peers is None:
                self.barrier()  # a runner's peers meet as their agreement ends, right after
            segments = self._instantiated()
        except BaseException:
            self.abort()
            raise
        self._scope.close()
        self.segments = []
        return Recording(tuple(segments), self.stream.device)

    def abort(self) -> None:
        """End a half-done capture, destroy what it made and close its scope; never raises
        (the error that caused the abort is the one to report)."""
        began, self.segment_open = self.segment_open, False
        torch_capture, self.torch_capture = self.torch_capture, None
        if torch_capture is not None:
            torch_capture.abort()
        elif began:  # only a capture this recorder began: another may be under way on the same stream
            bindings.discard_capture(self._handle)
        for segment in self.segments:
            segment.release()
        self.segments = []
        bindings.clear_last_error()
        self._scope.close()


def start(pool: torch.cuda.MemPool, stream: torch.cuda.Stream, options: CaptureOptions, record_addresses: bool) -> Recorder:
    """A recorder for a capture on ``stream`` (already the current stream) into ``pool``, opened."""
    recorder = Recorder(pool, stream, options, record_addresses)
    recorder.open()
    return recorder
