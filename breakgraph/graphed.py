"""The callable form: capture ``fn`` on static arguments once, replay it many times.

``graphed`` and every graph of a :class:`~breakgraph.GraphRunner` go through
:class:`GraphedCallable`: warm-up, debug mode and capture are written once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any, Callable

import torch

from breakgraph import context, runtime, trees
from breakgraph.capture import BreakableCUDAGraphCapture
from breakgraph.eager import eager_on_graph
from breakgraph.graph import BreakableCUDAGraph
from breakgraph.options import CaptureOptions, parse_warmup
from breakgraph.pool import require_pool
from breakgraph.writeback import make_writer


class GraphedCallable:
    """``fn`` captured on static arguments; :meth:`replay` re-runs it and returns its static output.

    Refill the static argument tensors in place (``x.copy_(new)``) between
    replays. The returned output is the capture-time object, refreshed by
    every replay: copy what you must keep. Without a GPU, or with
    ``BREAKGRAPH_DISABLE=1``, ``graph`` is None: ``fn`` runs once here and at
    every replay, and each result is written into that first output, so the
    contract is the same (one output object, refreshed in place).
    ``options`` is how the capture treats random ops, breaks and barriers
    (:class:`~breakgraph.options.CaptureOptions`, parsed where the user gave them).
    """

    def __init__(
        self,
        fn: Callable,
        args: tuple,
        kwargs: dict,
        options: CaptureOptions = CaptureOptions(),
        *,
        debug: bool | None = None,
        pool=None,
        warmup: int = 1,
        warn: bool = True,
    ):
        if not callable(fn):
            raise TypeError(f"expected a callable to capture, got {type(fn).__name__}")
        warmup = parse_warmup(warmup, allow_auto=False)
        if pool is not None:
            require_pool(pool)
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.debug = runtime.debug_requested(debug)
        self.options = options
        if self.debug:  # the whole function is one eager break, whatever the breaks mode
            self.options = dataclasses.replace(self.options, breaks="eager")
        self.output: Any = None
        self.graph: BreakableCUDAGraph | None = None
        self._write_eager_result = None
        reason = runtime.eager_fallback_reason()
        if reason is not None:
            if warn:
                warnings.warn(f"breakgraph: {reason}; {_name(fn)} runs eagerly on every replay", stacklevel=3)
            self.output = fn(*args, **kwargs)
            self._write_eager_result = make_writer(_name(fn), self.output)
            return
        self.graph = BreakableCUDAGraph(pool=pool, debug=self.debug)
        self._capture(warmup)

    def _capture(self, warmup: int) -> None:
        fn, args, kwargs = self.fn, self.args, self.kwargs
        with runtime.claim_capture_stream(_device_of(args, kwargs)) as stream:
            # Lazy library initialisation must not happen inside the capture: warm up what it records.
            with context.full_graph_warmup() if self.options.breaks == "inline" else contextlib.nullcontext():
                for _ in range(warmup):
                    runtime.run_on_stream(stream, lambda: fn(*args, **kwargs))
            # Debug mode: the whole function is one eager break, replayed through the same path.
            target = eager_on_graph(fn) if self.debug else fn
            with BreakableCUDAGraphCapture(self.graph, stream=stream, **self.options.arguments()):
                self.output = target(*args, **kwargs)

    @property
    def eager(self) -> bool:
        """True when this callable runs ``fn`` eagerly instead of replaying a graph."""
        return self.graph is None

    def replay(self):
        """Re-run ``fn`` on the static arguments (a graph replay, or an eager call without a
        GPU) and return its output object, refreshed in place."""
        if self.graph is None:
            self._write_eager_result(self.fn(*self.args, **self.kwargs))
        else:
            self.graph.replay()
        return self.output

    def __call__(self, *args, **kwargs):
        """:meth:`replay`; it takes no inputs: the graph reads the static arguments it was captured on."""
        if args or kwargs:
            raise TypeError(
                f"a graphed callable takes no arguments: it replays {_name(self.fn)} on the static arguments it "
                "was captured with. Copy new values into those tensors in place (x.copy_(new)), then call "
                "step() or step.replay(); for batches whose size changes, use bg.GraphRunner"
            )
        return self.replay()


def _name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def _device_of(args: tuple, kwargs: dict) -> torch.device:
    """The device of the first CUDA tensor argument, else the current device."""
    leaves, _spec = trees.flatten((args, kwargs), objects=False)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.is_cuda:
            return leaf.device
    return torch.device("cuda", torch.cuda.current_device())


def graphed(
    fn: Callable,
    *static_args,
    debug: bool | None = None,
    pool=None,
    warmup: int = 1,
    random_ops: str = "graph",
    generators=(),
    breaks: str = "eager",
    barrier_fn=None,
    **static_kwargs,
) -> GraphedCallable:
    """Capture ``fn(*static_args, **static_kwargs)`` as a breakable graph.

    ``fn`` first runs ``warmup`` times eagerly on the capture stream (lazy
    library initialisation must not happen inside a capture; pass 0 if it has
    side effects that must not repeat); before a full graph
    (``breaks="inline"``) its breaks run their capturable variants, which the
    graph records. ``debug`` (default ``BREAKGRAPH_DEBUG``)
    makes the whole function one eager break replayed through the same code
    path, with debug checks. ``random_ops``, ``generators``, ``breaks`` and
    ``barrier_fn`` are as for :class:`BreakableCUDAGraphCapture`. Without a
    GPU, or with ``BREAKGRAPH_DISABLE=1``, replay calls ``fn`` eagerly (one
    warning).
    """
    options = CaptureOptions.parse(random_ops=random_ops, generators=generators, breaks=breaks, barrier_fn=barrier_fn)
    return GraphedCallable(fn, static_args, static_kwargs, options, debug=debug, pool=pool, warmup=warmup)
