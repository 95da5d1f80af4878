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
import inspect
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

import breakgraph_bindings as bindings
from breakgraph_bindings import CaptureMode, CudaError
from breakgraph import context, rng, runtime, streams, trees
from breakgraph.aliasing import alias_leaves, alias_result
from breakgraph.dispatch import CaptureDispatchMode
from breakgraph.segments import EagerSegment, GraphSegment, Launcher, Segment
from breakgraph.writeback import make_writer

RANDOM_OPS = ("graph", "break", "error")


def parse_random_ops(random_ops: str) -> str:
    """Check ``random_ops``: "graph" (captured into segments), "break" (each random op an
    eager break, through the op watch) or "error" (refused)."""
    if random_ops not in RANDOM_OPS:
        raise ValueError(f"random_ops must be 'graph', 'break' or 'error', got {random_ops!r}")
    return random_ops


def parse_generators(generators) -> tuple[torch.Generator, ...]:
    """Check ``generators``: CUDA ``torch.Generator``s a capture arms beside the default one."""
    generators = tuple(generators or ())
    for gen in generators:
        if not isinstance(gen, torch.Generator) or gen.device.type != "cuda":
            raise TypeError(f"generators must be CUDA torch.Generator objects, got {gen!r}")
    return generators


_warned_uncooperative = False


def _warn_uncooperative() -> None:
    global _warned_uncooperative
    if not _warned_uncooperative:
        _warned_uncooperative = True
        warnings.warn(
            f"breakgraph: torch {torch.__version__}'s CUDA generators cannot be armed for captures made "
            "through cuda.bindings; random ops become eager breaks (random_ops='break')",
            stacklevel=4,
        )


@dataclass(frozen=True)
class Recording:
    """What a finished capture hands its graph: the segments, the device, and the step that
    refills the armed generators before each replay (None when no segment drew random numbers)."""

    segments: tuple[Segment, ...]
    device: torch.device
    refill_generators: Launcher | None


class Recorder:
    """The state of one active capture (one thread, one capture stream)."""

    def __init__(self, stream: torch.cuda.Stream, mode: CaptureMode, random_ops: str, record_addresses: bool):
        self.stream = stream
        self.mode = mode
        self.random_ops = random_ops
        self.record_addresses = record_addresses
        self.random: rng.ArmedGenerators | None = None
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
        """End the open segment; keep it unless it captured nothing."""
        side_streams = self.tracker.segment_ending()
        self.segment_open = False
        if self.random is not None:
            self.random.point_at_plain_states()
        graph = bindings.end_capture(self.stream)
        num_nodes = graph.num_nodes
        if num_nodes == 0:
            graph.destroy()
            return
        executable = graph.instantiate()  # its first launch uploads it
        name = f"graph {self._previous} -> {following}"
        self.segments.append(GraphSegment(len(self.segments), name, graph, executable, num_nodes, side_streams))

    # -- breaks ------------------------------------------------------------------------
    def run_break(self, function: Callable, args: tuple, kwargs: dict, name: str | None = None) -> Any:
        """End the segment, run ``function`` eagerly and record it, begin the next segment."""
        name = name or _function_name(function)
        self.end_segment(following=f"{name}()")
        result = function(*args, **kwargs)
        self.segments.append(self._record_break(name, function, args, kwargs, result))
        self._previous = f"{name}()"
        self.begin_segment()
        return result

    def _record_break(self, name: str, function: Callable, args: tuple, kwargs: dict, result) -> EagerSegment:
        has_arguments = bool(args or kwargs)
        arg_leaves, arg_spec = trees.flatten((args, kwargs), objects=False) if has_arguments else ([], None)
        if result is None:
            kept, write = None, make_writer(name, None, None)
        else:
            flat = trees.take_apart(result, objects=True)
            reject_autograd_history(name, flat, arg_leaves)
            kept, kept_flat = alias_result(result, flat)
            write = make_writer(name, kept, kept_flat)
        replay_args, replay_kwargs = trees.unflatten(arg_spec, alias_leaves(arg_leaves)) if has_arguments else ((), {})
        return EagerSegment(
            len(self.segments),
            name,
            _with_capture_autocast(function),
            replay_args,
            replay_kwargs,
            kept,
            write,
            _argument_addresses(function, args, kwargs) if self.record_addresses else (),
        )

    # -- the whole capture -----------------------------------------------------------------
    def finish(self) -> Recording:
        """End the last segment and close the capture's scope; the recording is the caller's now."""
        try:
            drawn = self.random is not None and self.random.drawn()  # asked while the last segment records
            self.end_segment(following="end")
            random, self.random = self.random, None
            refill = random.disarm(keep=drawn) if random is not None else None
        except BaseException:
            self.abort()
            raise
        self._scope.close()
        segments, self.segments = self.segments, []
        return Recording(tuple(segments), self.stream.device, refill)

    def abort(self) -> None:
        """End a half-done capture, destroy what it made and close its scope; never raises
        (the error that caused the abort is the one to report)."""
        self.segment_open = False
        try:
            if bindings.capture_status(self.stream) is not bindings.CaptureStatus.NONE:
                bindings.end_capture(self.stream).destroy()
        except CudaError:
            pass  # an invalidated capture: ending it failed, and the stream has left capture mode
        for segment in self.segments:
            segment.release()
        self.segments = []
        if self.random is not None:
            random, self.random = self.random, None
            with contextlib.suppress(Exception):
                random.disarm(keep=False)
        bindings.clear_last_error()
        self._scope.close()


def start(
    pool,
    stream: torch.cuda.Stream,
    mode: CaptureMode,
    random_ops: str,
    generators: tuple[torch.Generator, ...],
    record_addresses: bool,
) -> Recorder:
    """Open a capture on ``stream`` (already the current stream) into ``pool``: arm the
    generators, route allocations to the pool, pause the cycle collector, hook
    ``wait_stream``, make the recorder this thread's active capture, and begin the
    first segment."""
    recorder = Recorder(stream, mode, random_ops, record_addresses)
    scope = recorder._scope
    watch, refuse_random = random_ops == "break", None
    try:
        # Outermost, so it is released last: a MemPool that a collection frees while
        # allocations are still routed to a pool aborts the process.
        scope.enter_context(runtime.cycle_collector_paused())
        if random_ops == "graph":
            if not rng.cooperative():
                _warn_uncooperative()
                watch = True
            else:
                try:  # before pool routing: torch keeps the generators' device state outside our pool
                    recorder.random = rng.ArmedGenerators(stream.device, generators)
                except rng.GeneratorBusy as busy:
                    watch, refuse_random = True, str(busy)
        scope.enter_context(torch.cuda.use_mem_pool(pool, stream.device))
        # Backward passes run on this thread, so their breaks and allocations are ours.
        scope.enter_context(torch.autograd.set_multithreading_enabled(False))
        streams.install_hooks()
        scope.callback(streams.remove_hooks)
        scope.callback(context.deactivate, context.activate(recorder))
        if watch:
            scope.enter_context(CaptureDispatchMode(recorder, refuse_random))
        recorder.begin_segment()
    except BaseException:
        recorder.abort()
        raise
    return recorder


def _function_name(function: Callable) -> str:
    return getattr(function, "__qualname__", None) or getattr(function, "__name__", None) or repr(function)


def _with_capture_autocast(function: Callable) -> Callable:
    """Replay ``function`` under the CUDA autocast state it was captured under."""
    if not torch.is_autocast_enabled("cuda"):
        return function
    dtype = torch.get_autocast_dtype("cuda")

    def under_autocast(*args, **kwargs):
        with torch.autocast("cuda", dtype=dtype):
            return function(*args, **kwargs)

    return under_autocast


def reject_autograd_history(name: str, result: trees.Flat, argument_leaves: list) -> None:
    """Refuse a break whose result carries autograd history made inside it.

    Its backward would read intermediates saved at capture time, which
    replay does not refresh. Inputs passed straight through are fine.
    """
    inputs = None
    for path, tensor in result.tensors_with_paths("out"):
        if tensor.grad_fn is None:
            continue
        if inputs is None:
            inputs = {id(leaf) for leaf in argument_leaves}
        if id(tensor) not in inputs:
            raise RuntimeError(
                f"{name}() -> {path} requires grad: a break's backward would read tensors saved at "
                "capture time, which replay does not refresh. Put the break inside a "
                "torch.autograd.Function whose forward and backward each call an "
                "@eager_on_graph function (see the README, 'Training')."
            )


def _argument_addresses(function: Callable, args: tuple, kwargs: dict) -> tuple:
    """(path, weak reference, data pointer) of every tensor argument, named as the
    function names them (``x``, ``parts['a']``), for debug mode's moved-input check."""
    try:
        bound = inspect.signature(function).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        bound = {f"args[{i}]": value for i, value in enumerate(args)} | dict(kwargs)
    return tuple(
        (path, weakref.ref(tensor), tensor.data_ptr())
        for key, value in bound.items()
        for path, tensor in trees.take_apart(value, objects=False).tensors_with_paths(str(key))
    )
