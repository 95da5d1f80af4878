"""The captured product: a breakable graph's segments, its replay, its reset.

Like ``torch.cuda.CUDAGraph``, a :class:`BreakableCUDAGraph` is captured
between :meth:`~BreakableCUDAGraph.capture_begin` and
:meth:`~BreakableCUDAGraph.capture_end` on the current stream (the
:class:`~breakgraph.BreakableCUDAGraphCapture` context manager calls them),
then replayed any number of times. What happens during capture is the
recorder's business (:mod:`breakgraph.recording.recorder`); what the graph holds
afterwards is a tuple of segments and the replay plan built from them
(:mod:`breakgraph.graphs.plan`).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

import torch

from breakgraph.base import context, runtime
from breakgraph.recording import recorder
from breakgraph.recording.dispatch import clearer_error
from breakgraph.base.options import CaptureOptions
from breakgraph.graphs.plan import ReplayPlan
from breakgraph.base.pool import OwnedPool, new_pool, require_pool
from breakgraph.recording.segments import Segment


class BreakableCUDAGraph:
    """A captured region: CUDA graph segments and the eager breaks between them.

    Arguments:
        pool (torch.cuda.MemPool, optional): a pool to share with another graph
            (pass ``other.pool``). Default: the graph makes its own on first
            capture. The pool lives as long as the graph, across :meth:`reset`.
        debug (bool, optional): replay checks argument addresses and
            synchronizes after every segment, naming the one that failed.
            None (default): ``BREAKGRAPH_DEBUG=1`` decides.
    """

    def __init__(self, pool: "torch.cuda.MemPool | None" = None, debug: bool | None = None):
        if pool is not None:
            require_pool(pool)
        # Everything that holds the segments before the pool, so a dropped graph lets them go
        # first: segments torch captured hold the pool in torch's allocator, and the pool
        # gives its memory back as it dies only when nothing holds it there.
        self._segments: tuple[Segment, ...] = ()
        self._plan: ReplayPlan | None = None
        self._replays: dict[int, Callable[[], None]] = {}  # the plan's by_stream: replay's one lookup
        self._pool = None if pool is None else OwnedPool(pool)
        self._current_stream: Callable[[], int | None] = _no_stream  # the raw stream replay runs on
        self.debug = debug  # None: BREAKGRAPH_DEBUG decides
        self.check_finite = False
        self._before_replay = self._after_replay = None
        self._device = None
        self._recorder: recorder.Recorder | None = None
        self._released = False  # executables released, graphs kept

    # -- introspection ----------------------------------------------------------
    @property
    def pool(self) -> torch.cuda.MemPool:
        """The ``torch.cuda.MemPool`` every segment allocates from."""
        if self._pool is None:
            runtime.require_cuda("BreakableCUDAGraph.pool (a torch.cuda.MemPool)")
            self._pool = OwnedPool(new_pool())
        return self._pool.pool

    @property
    def segments(self) -> tuple[Segment, ...]:
        """Segments in replay order; each has ``kind`` ("graph" | "eager"), ``name``, ``num_nodes``."""
        return self._segments

    @property
    def num_graphs(self) -> int:
        return self._count("graph")

    @property
    def num_eager_breaks(self) -> int:
        return self._count("eager")

    def _count(self, kind: str) -> int:
        return sum(segment.kind == kind for segment in self._segments)

    @property
    def bytes_written_per_replay(self) -> int:
        """Bytes the eager breaks copied back into captured buffers during the last replay."""
        return sum(segment.bytes_written for segment in self._segments)

    @property
    def captured(self) -> bool:
        return self._plan is not None or self._released

    @property
    def released(self) -> bool:
        """Whether :meth:`release_executables` left this graph without executables."""
        return self._released

    @property
    def executable_bytes(self) -> int | None:
        """Device memory the driver took for this graph's own executables, measured with
        ``cudaMemGetInfo`` at instantiation (segments sharing another graph's count 0);
        None when the capture did not measure (``measure_memory=False``)."""
        measured = [segment.executable_bytes for segment in self._segments]
        return None if None in measured else sum(measured)

    @property
    def device(self) -> torch.device | None:
        """The device the graph was captured on (None before capture)."""
        return self._device

    @property
    def draws_random_numbers(self) -> bool:
        """Whether segments captured random ops: torch captured those segments, and each
        replay of one refills and advances the generators, as ``torch.cuda.CUDAGraph.replay``
        does."""
        return any(segment.draws_random_numbers for segment in self._segments)

    # -- capture ------------------------------------------------------------------------
    def capture_begin(self, *, options: CaptureOptions | None = None, **capture_options: Any) -> None:
        """Begin capturing on the current stream, which must not be the default stream.

        Prefer :class:`~breakgraph.BreakableCUDAGraphCapture`, which picks a
        side stream and calls this and :meth:`capture_end` (or
        :meth:`capture_abort`) for you.

        Arguments:
            options (CaptureOptions, optional): how the capture treats random ops,
                breaks and barriers. Default: ``CaptureOptions()``.
            **capture_options: any field of :class:`~breakgraph.CaptureOptions` by
                name, set on top of ``options``.
        """
        options = CaptureOptions.build("BreakableCUDAGraph.capture_begin", options, capture_options)
        runtime.require_capture("BreakableCUDAGraph.capture_begin")
        stream = torch.cuda.current_stream(torch.cuda.current_device())
        if context.current() is not None:
            raise RuntimeError(
                "nested breakable CUDA graph captures are not supported: this thread is already capturing. "
                "End the outer capture first, or mark the inner region @eager_on_graph."
            )
        if self.captured or self._recorder is not None:
            raise RuntimeError("this BreakableCUDAGraph already holds a capture; call graph.reset() before capturing again")
        if stream.cuda_stream in (0, _default_stream_handle(stream.device_index)):
            raise ValueError(
                "cannot capture on the default CUDA stream; make a torch.cuda.Stream() current, or use "
                "BreakableCUDAGraphCapture, which captures on breakgraph's side stream"
            )
        self._recorder = recorder.start(self.pool, stream, options, record_addresses=self.debug)

    def capture_end(self) -> None:
        """End the capture begun by :meth:`capture_begin`; the graph can be replayed now."""
        active, self._recorder = self._require_recorder(), None
        try:
            recording = active.finish()
        except BaseException as error:
            clearer = clearer_error(error, active.options.random_ops)
            if clearer is not None:
                raise clearer from error
            raise
        self._segments = recording.segments
        self._device = recording.device
        self._current_stream = functools.partial(torch._C._cuda_getCurrentRawStream, recording.device.index)
        self._build_plan()

    def capture_abort(self) -> None:
        """End the capture begun by :meth:`capture_begin` after a failure: the CUDA capture
        is ended, what it made is destroyed, hooks and pool routing are restored."""
        active, self._recorder = self._require_recorder(), None
        active.abort()

    def _require_recorder(self) -> recorder.Recorder:
        if self._recorder is None:
            raise RuntimeError("this BreakableCUDAGraph is not capturing: call capture_begin() first")
        return self._recorder

    def set_replay_hooks(self, before: Callable[[], Any] | None = None, after: Callable[[], Any] | None = None) -> None:
        """Call hooks around every replay (an engine syncing its weight offloader, or timing
        steps). A hook that is not set costs replay nothing: it is not in the replay plan.
        Hooks run as breaks do, with autograd and CUDA autocast off.

        Arguments:
            before (callable, optional): called ahead of every replay; None removes it.
            after (callable, optional): called once the replay is launched; None removes it.
        """
        check_replay_hooks(before, after)
        if before is self._before_replay and after is self._after_replay:
            return  # the plan has them already
        self._before_replay, self._after_replay = before, after
        if self._plan is not None:
            self._build_plan()

    # -- executables --------------------------------------------------------------------
    def release_executables(self) -> None:
        """Destroy the segments' executables (the device memory the driver holds for them)
        and keep the captured graphs and the pool: :meth:`restore_executables` brings the
        graph back without capturing again. Replay raises until then."""
        self._require_captured("release_executables")
        for segment in self._segments:
            segment.drop_executable()
        self._use_plan(None)
        self._released = True

    def restore_executables(self) -> None:
        """Instantiate the segments kept by :meth:`release_executables` again; replays are
        then those of before (the same graphs, reading and writing the same addresses)."""
        if not self._released:
            return
        stream = torch.cuda.current_stream(self._device)
        for segment in self._segments:
            segment.instantiate(stream)
        self._released = False
        self._build_plan()

    def rebuild_replay_plan(self) -> None:
        """Rebuild the replay plan after segments changed how they launch (shared executables)."""
        self._require_captured("rebuild_replay_plan")
        if not self._released:
            self._build_plan()

    def _require_captured(self, what: str) -> None:
        if not self.captured:
            raise RuntimeError(f"{what} needs a captured graph: capture it first")

    def _build_plan(self) -> None:
        """The replay plan: the hooks this graph has, its segments, debug mode's checks if on.
        It refers to the graph weakly: a graph and its plan holding each other would keep a
        dropped graph's memory until the garbage collector ran."""
        graph = weakref.ref(self)
        self._use_plan(ReplayPlan(self._segments, self._before_replay, self._after_replay, self.debug, lambda: graph().check_finite))

    def _use_plan(self, plan: ReplayPlan | None) -> None:
        """Replay by ``plan`` from now on (None: replay raises); the functions of the plan before go."""
        self._plan = plan
        self._replays = {} if plan is None else plan.by_stream

    # -- replay -------------------------------------------------------------------------
    def replay(self) -> None:
        """Launch every segment and run every break, in capture order, on the current stream."""
        # The first replay on a stream writes its function; later ones find it by one lookup.
        # A step bound by the host waits for this method before its first launch: each
        # attribute it reads and each call it makes is paid on every replay.
        replay = self._replays.get(self._current_stream())
        if replay is None:
            replay = self._first_replay_on_current_stream()
        replay()

    def _first_replay_on_current_stream(self) -> Callable[[], None]:
        plan = self._plan
        if plan is None:
            if self._released:
                raise RuntimeError("this graph's executables were released (release_executables()): call restore_executables() first")
            raise RuntimeError("this BreakableCUDAGraph holds no capture: capture it with BreakableCUDAGraphCapture first")
        return plan.compile(self._current_stream())

    # -- lifecycle ----------------------------------------------------------------------
    def reset(self) -> None:
        """Destroy the segments and drop the breaks' buffers; the pool stays, so the
        graph (and graphs sharing its pool) can be captured again."""
        for segment in self._segments:
            segment.release()
        self._segments = ()
        self._use_plan(None)
        self._released = False

    @property
    def debug(self) -> bool:
        """Replay checks argument addresses and synchronizes after every segment, naming the one that failed.
        Switched on after the capture, replay synchronizes; the addresses are recorded, and so checked,
        only by a capture made in debug mode."""
        return self._debug

    @debug.setter
    def debug(self, value: bool) -> None:
        self._debug = runtime.debug_requested(value)
        if self._plan is not None:
            self._build_plan()

    def __repr__(self) -> str:
        return f"BreakableCUDAGraph(num_graphs={self.num_graphs}, num_eager_breaks={self.num_eager_breaks})"


def check_replay_hooks(before, after) -> None:
    """Refuse replay hooks that cannot be called."""
    for name, hook in (("before", before), ("after", after)):
        if hook is not None and not callable(hook):
            raise TypeError(f"replay hook {name!r} must be callable or None, got {type(hook).__name__}")


@functools.cache
def _default_stream_handle(device_index: int) -> int:
    return torch.cuda.default_stream(device_index).cuda_stream


def _no_stream() -> None:
    """The current stream of a graph not captured yet: no stream has a replay function."""
    return None
