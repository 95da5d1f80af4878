"""Breakable capture and replay: one region, many CUDA graph segments, eager breaks between.

Capture drives the CUDA runtime directly (``cudaStreamBeginCapture`` …
``cudaGraphLaunch`` through :mod:`bindings`); torch contributes tensors and
its caching allocator, routed to the graph's private memory pool for the
whole capture, eager breaks included.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import threading
import weakref
from typing import Any, Callable

import torch

import bindings
from bindings import CaptureMode, CudaError
from breakgraph import context, streams
from breakgraph.aliasing import alias_result, alias_tree, tensor_leaves
from breakgraph.config import capture_disabled, cuda_available, debug_requested
from breakgraph.dispatch import (
    CaptureDispatchMode,
    UncapturableOpError,
    is_capture_violation,
    is_random_op_refusal,
    random_op_uncapturable,
    uncapturable,
)
from breakgraph.pool import new_pool
from breakgraph.segments import EagerSegment, GraphSegment
from breakgraph.writeback import make_writer

_launch = bindings.launch_function()


class BreakableCUDAGraph:
    """A captured region: CUDA graph segments and the eager breaks between them.

    ``pool`` is a ``torch.cuda.MemPool`` to share with another graph (pass
    ``other.pool``); by default the graph makes its own on first capture. The
    pool lives as long as the graph, across :meth:`reset`. ``debug`` (default:
    ``BREAKGRAPH_DEBUG``) makes replay check argument addresses and
    synchronize after every segment, naming the one that failed.
    """

    def __init__(self, pool=None, debug: bool | None = None):
        self._pool = pool
        self.debug = debug_requested(debug)
        self.check_finite = False
        self._segments: list[GraphSegment | EagerSegment] = []
        self._plan: tuple = ()
        self._captured = False
        self._device_index = 0

    # -- introspection ----------------------------------------------------------
    @property
    def pool(self):
        """The ``torch.cuda.MemPool`` every segment allocates from."""
        if self._pool is None:
            self._pool = new_pool()
        return self._pool

    @property
    def segments(self) -> tuple[GraphSegment | EagerSegment, ...]:
        """Segments in replay order; each has ``kind`` ("graph" | "eager"), ``name``, ``num_nodes``."""
        return tuple(self._segments)

    @property
    def num_graphs(self) -> int:
        return sum(1 for segment in self._segments if segment.kind == "graph")

    @property
    def num_eager_breaks(self) -> int:
        return sum(1 for segment in self._segments if segment.kind == "eager")

    @property
    def bytes_written_per_replay(self) -> int:
        """Bytes the eager breaks copied back into captured buffers during the last replay."""
        return sum(segment.bytes_written for segment in self._segments if segment.kind == "eager")

    @property
    def captured(self) -> bool:
        return self._captured

    # -- replay -------------------------------------------------------------------
    def replay(self) -> None:
        """Launch every segment and run every break, in capture order, on the current stream."""
        if not self._captured:
            raise RuntimeError("this BreakableCUDAGraph holds no capture: capture it with BreakableCUDAGraphCapture first")
        if self.debug:
            return self._replay_debug()
        stream = bindings.stream_handle(_current_raw_stream(self._device_index))
        with torch.no_grad():
            for handle, call in self._plan:
                if call is None:
                    err = _launch(handle, stream)[0]
                    if err:
                        self._raise_launch_error(err, handle)
                else:
                    call()

    def _raise_launch_error(self, err, handle) -> None:
        bindings.clear_last_error()
        index = next(i for i, (h, _call) in enumerate(self._plan) if h is handle)
        raise CudaError(err, "cudaGraphLaunch", f"segment {index}: {self._segments[index].name}")

    def _replay_debug(self) -> None:
        from breakgraph.debug import replay_checked

        replay_checked(self)

    # -- lifecycle ------------------------------------------------------------------
    def reset(self) -> None:
        """Destroy the segments and drop the breaks' buffers; the pool stays, so the
        graph (and graphs sharing its pool) can be captured again."""
        for segment in self._segments:
            segment.release()
        self._segments = []
        self._plan = ()
        self._captured = False

    def _install(self, segments: list, device_index: int) -> None:
        self._segments = segments
        self._device_index = device_index
        self._plan = tuple(
            (segment.executable.handle, None) if segment.kind == "graph" else (None, segment.replayer())
            for segment in segments
        )
        self._captured = True

    # -- diagnostics (breakgraph.debug) ---------------------------------------------
    def summary(self, print_table: bool = True) -> str:
        """A table of segments: kind, name, nodes, side streams, bytes written back."""
        from breakgraph.debug import summary

        return summary(self, print_table)

    def to_dot(self, directory, render: bool = True) -> list:
        """Write one DOT file per graph segment plus an overview of the chain; see :mod:`breakgraph.debug`."""
        from breakgraph.debug import to_dot

        return to_dot(self, directory, render)

    def profile(self, iters: int = 20, warmup: int = 3):
        """Time each segment with CUDA events over ``iters`` replays; see :mod:`breakgraph.debug`."""
        from breakgraph.debug import profile

        return profile(self, iters, warmup)

    def __repr__(self) -> str:
        return f"BreakableCUDAGraph(num_graphs={self.num_graphs}, num_eager_breaks={self.num_eager_breaks})"


def _current_raw_stream(device_index: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device_index)


class CaptureSession:
    """The state of one active capture (one thread, one capture stream)."""

    def __init__(self, graph: BreakableCUDAGraph, stream: torch.cuda.Stream, mode: CaptureMode):
        self.graph = graph
        self.stream = stream
        self.mode = mode
        self.segments: list[GraphSegment | EagerSegment] = []
        self.segment_open = False
        self.tracker = streams.ForkJoinTracker(
            stream,
            bindings.capture_info,
            join=streams.original_wait_stream,
            fork=streams.original_wait_stream,
        )
        self._next_graph_name = "start"

    # -- segment boundaries ----------------------------------------------------------
    def begin_segment(self) -> None:
        bindings.begin_capture(self.stream, self.mode)
        self.segment_open = True
        self.tracker.segment_begun()

    def end_segment(self, following: str) -> None:
        """End the open segment; keep it unless it captured nothing."""
        side_streams = self.tracker.segment_ending()
        self.segment_open = False
        graph = bindings.end_capture(self.stream)
        num_nodes = graph.num_nodes
        if num_nodes == 0:
            graph.destroy()
        else:
            executable = graph.instantiate()  # its first launch uploads it
            name = f"graph {self._next_graph_name} -> {following}"
            self.segments.append(GraphSegment(len(self.segments), name, graph, executable, num_nodes, side_streams))

    def run_break(self, function: Callable, args: tuple, kwargs: dict, name: str | None = None) -> Any:
        """End the segment, run ``function`` eagerly and record it, begin the next segment."""
        name = name or _function_name(function)
        self.end_segment(following=f"{name}()")
        result = function(*args, **kwargs)
        _reject_autograd_history(name, result, args, kwargs)
        addresses = _argument_addresses(function, args, kwargs) if self.graph.debug else ()
        kept = alias_result(result)
        self.segments.append(
            EagerSegment(
                len(self.segments),
                name,
                _with_capture_autocast(function),
                alias_tree(args) if args else (),
                alias_tree(kwargs) if kwargs else {},
                kept,
                make_writer(name, kept),
                addresses,
            )
        )
        self._next_graph_name = f"{name}()"
        self.begin_segment()
        return result

    def finish(self) -> list:
        self.end_segment(following="end")
        return self.segments

    def abort(self) -> None:
        """End a half-done capture and destroy what it made; never raises."""
        self.segment_open = False
        try:
            if bindings.capture_status(self.stream) is not bindings.CaptureStatus.NONE:
                bindings.end_capture(self.stream).destroy()
        except CudaError:
            pass  # an invalidated capture: ending it failed, and the stream has left capture mode
        for segment in self.segments:
            segment.release()
        self.segments = []
        bindings.clear_last_error()


def _with_capture_autocast(function: Callable) -> Callable:
    """Replay ``function`` under the CUDA autocast state it was captured under."""
    if not torch.is_autocast_enabled("cuda"):
        return function
    dtype = torch.get_autocast_dtype("cuda")

    def under_autocast(*args, **kwargs):
        with torch.autocast("cuda", dtype=dtype):
            return function(*args, **kwargs)

    return under_autocast


def _function_name(function: Callable) -> str:
    return getattr(function, "__qualname__", None) or getattr(function, "__name__", None) or repr(function)


def _reject_autograd_history(name: str, result, args: tuple, kwargs: dict) -> None:
    """Refuse a break whose result carries autograd history made inside it.

    Its backward would read intermediates saved at capture time, which
    replay does not refresh. Inputs passed straight through are fine.
    """
    inputs = None
    for path, tensor in tensor_leaves(result, "out"):
        if tensor.grad_fn is None:
            continue
        if inputs is None:
            inputs = {id(t) for _path, t in tensor_leaves((args, kwargs), "")}
        if id(tensor) not in inputs:
            raise RuntimeError(
                f"{name}() -> {path} requires grad: a break's backward would read tensors saved at "
                "capture time, which replay does not refresh. Put the break inside a "
                "torch.autograd.Function whose forward and backward each call an "
                "@eager_on_graph function (see the README, 'Training')."
            )


def _argument_addresses(function: Callable, args: tuple, kwargs: dict):
    try:
        bound = inspect.signature(function).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        bound = {f"args[{i}]": value for i, value in enumerate(args)} | dict(kwargs)
    return tuple(
        (path, weakref.ref(tensor), tensor.data_ptr())
        for key, value in bound.items()
        for path, tensor in tensor_leaves(value, str(key))
    )


_gc_lock = threading.Lock()
_gc_holds = 0
_gc_was_enabled = False


def _pause_gc() -> None:
    """Keep Python's cycle collector from running during any capture.

    A collection mid-capture can destroy an unrelated ``MemPool`` whose
    destructor frees device memory, which CUDA forbids while a stream is
    capturing (the process aborts). Reference-counted across threads.
    """
    global _gc_holds, _gc_was_enabled
    with _gc_lock:
        if _gc_holds == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_holds += 1


def _resume_gc() -> None:
    global _gc_holds
    with _gc_lock:
        _gc_holds -= 1
        if _gc_holds == 0 and _gc_was_enabled:
            gc.enable()


_capture_streams = threading.local()


def _default_capture_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per thread and device, as ``torch.cuda.graph`` keeps one per process."""
    cache = _capture_streams.__dict__.setdefault("by_device", {})
    stream = cache.get(device.index)
    if stream is None:
        stream = cache[device.index] = torch.cuda.Stream(device)
    return stream


def _refuse_without_cuda() -> None:
    if capture_disabled():
        raise RuntimeError(
            "BREAKGRAPH_DISABLE=1 is set, and a `with BreakableCUDAGraphCapture(...)` block cannot be "
            "re-run eagerly at replay. Use breakgraph.graphed(fn, *args) (or GraphRunner), which "
            "falls back to calling fn eagerly."
        )
    if not cuda_available():
        raise RuntimeError(
            "BreakableCUDAGraphCapture needs a CUDA GPU, and none is available. Use "
            "breakgraph.graphed(fn, *args) (or GraphRunner) instead: without a GPU it calls fn eagerly "
            "on every replay, so the same code runs everywhere."
        )


class BreakableCUDAGraphCapture:
    """Context manager that captures its body into ``graph``.

    Graphable work becomes CUDA graph segments; ``@eager_on_graph`` functions,
    :func:`break_graph` and random ops end the current segment, run eagerly and
    are recorded for replay. Like ``torch.cuda.graph`` it captures on a side
    stream (``stream``, or one kept per thread) that first waits on the
    current stream's work; unlike it, it does not synchronize the device. The
    default stream is refused. ``capture_error_mode`` is CUDA's capture mode:
    "global", "thread_local" or "relaxed".

    ``random_ops="break"`` (default) watches every op while a segment is
    captured (a ``TorchDispatchMode``): random ops become eager breaks that
    draw fresh numbers at each replay, and host-sync ops fail before they
    reach CUDA. That costs a Python call per op at capture, not at replay.
    ``random_ops="error"`` skips the watch, for faster captures of models
    with no random ops: a random op then fails the capture with a clear error.

    Any exception inside the block ends the CUDA capture, discards what was
    captured, restores the stream, pool routing and hooks, and propagates.
    """

    def __init__(
        self,
        graph: BreakableCUDAGraph,
        stream: torch.cuda.Stream | None = None,
        capture_error_mode: str = "global",
        random_ops: str = "break",
    ):
        if not isinstance(graph, BreakableCUDAGraph):
            raise TypeError(f"expected a BreakableCUDAGraph, got {type(graph).__name__}")
        self.graph = graph
        self.stream = stream
        self.mode = CaptureMode.parse(capture_error_mode)
        self.watch_ops = _parse_random_ops(random_ops)
        self._session: CaptureSession | None = None
        self._exit_stack: contextlib.ExitStack | None = None

    def __enter__(self) -> BreakableCUDAGraph:
        _refuse_without_cuda()
        if context.current_session() is not None:
            raise RuntimeError(
                "nested breakable CUDA graph captures are not supported: this thread is already capturing. "
                "End the outer capture first, or mark the inner region @eager_on_graph."
            )
        if self.graph.captured:
            raise RuntimeError("this BreakableCUDAGraph already holds a capture; call graph.reset() before capturing again")
        caller_stream = torch.cuda.current_stream()
        stream = self.stream if self.stream is not None else _default_capture_stream(caller_stream.device)
        if stream.cuda_stream == 0 or stream == torch.cuda.default_stream(stream.device):
            raise ValueError(
                "cannot capture on the default CUDA stream; pass a torch.cuda.Stream() as `stream` "
                "or leave it as None to use breakgraph's side stream"
            )
        # No host sync: the capture stream only has to follow the caller's work on the
        # GPU, so an engine's warm-up step can still run while its capture is recorded.
        stream.wait_stream(caller_stream)

        session = CaptureSession(self.graph, stream, self.mode)
        exit_stack = contextlib.ExitStack()
        try:
            exit_stack.enter_context(torch.cuda.stream(stream))
            exit_stack.enter_context(torch.cuda.use_mem_pool(self.graph.pool, stream.device))
            # Backward passes run on this thread, so their breaks and allocations are ours.
            exit_stack.enter_context(torch.autograd.set_multithreading_enabled(False))
            _pause_gc()
            exit_stack.callback(_resume_gc)
            streams.install_hooks()
            exit_stack.callback(streams.remove_hooks)
            exit_stack.callback(context.deactivate, context.activate(session))
            if self.watch_ops:
                exit_stack.enter_context(CaptureDispatchMode(session))
            session.begin_segment()
        except BaseException:
            session.abort()
            exit_stack.close()
            raise
        self._session, self._exit_stack, self._caller_stream = session, exit_stack, caller_stream
        return self.graph

    def __exit__(self, exc_type, exc, tb) -> bool:
        session, exit_stack = self._session, self._exit_stack
        self._session = self._exit_stack = None
        if exc_type is None:
            try:
                segments = session.finish()
            except BaseException as error:
                session.abort()
                exit_stack.close()
                _reraise_clearly(error)
                raise
            exit_stack.close()
            self.graph._install(segments, session.stream.device.index)
            self._caller_stream.wait_stream(session.stream)
            return False
        session.abort()
        exit_stack.close()
        _reraise_clearly(exc)
        return False


def _parse_random_ops(random_ops: str) -> bool:
    """Whether ops are watched during capture: ``random_ops`` is "break" or "error"."""
    if random_ops not in ("break", "error"):
        raise ValueError(f"random_ops must be 'break' or 'error', got {random_ops!r}")
    return random_ops == "break"


def _reraise_clearly(error: BaseException) -> None:
    """Turn CUDA's bare capture-violation errors into ones that name the remedy."""
    if is_random_op_refusal(error) and not isinstance(error, UncapturableOpError):
        raise random_op_uncapturable(error) from error
    if is_capture_violation(error) and not isinstance(error, UncapturableOpError):
        raise uncapturable("an operation in this graph segment", error) from error
