"""The callable form: capture ``fn`` on static arguments once, replay it many times.

``graphed`` and every graph of a :class:`~breakgraph.GraphRunner` go through
:class:`GraphedCallable`: warm-up, debug mode and capture are written once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any, Callable

import torch

from breakgraph.base import context, runtime, trees
from breakgraph.recording import rng
from breakgraph.graphs.capture import BreakableCUDAGraphCapture
from breakgraph.base.checks import near_miss
from breakgraph.recording.dispatch import UncapturableOpError, is_random_op_refusal
from breakgraph.recording.eager import eager_on_graph
from breakgraph.graphs.graph import BreakableCUDAGraph
from breakgraph.base.naming import function_name
from breakgraph.base.options import CaptureOptions, parse_warmup
from breakgraph.recording.outputs import check_output
from breakgraph.base.pool import require_pool
from breakgraph.recording.writeback import make_writer


class GraphedCallable:
    """``fn`` captured on static arguments; :meth:`replay` re-runs it and returns its static output.

    Refill the static argument tensors in place (``x.copy_(new)``) between
    replays. The returned output is the capture-time object, refreshed by
    every replay: copy what you must keep. Without a GPU, or with
    ``BREAKGRAPH_DISABLE=1``, ``graph`` is None: ``fn`` runs once here and at
    every replay, and each result's tensors are written into that first output,
    so the contract is the same (one output object, its tensors refreshed in
    place). What else an output may hold is :mod:`breakgraph.recording.outputs`'s rule,
    checked at capture.

    Arguments:
        fn (callable): the function to capture.
        args (tuple): its static positional arguments.
        kwargs (dict): its static keyword arguments.
        options (CaptureOptions, optional): how the capture treats random ops,
            breaks and barriers. Default: ``CaptureOptions()``.
        debug (bool, optional): debug mode; None (default): ``BREAKGRAPH_DEBUG=1`` decides.
        pool (torch.cuda.MemPool, optional): a pool to share. Default: the graph's own.
        warmup (int, optional): eager runs before the capture. Default: 1.
        warn (bool, optional): warn once when ``fn`` runs eagerly for want of a GPU. Default: True.
        draws_random_numbers (bool, optional): whether ``fn`` is known to draw random
            numbers. None (default): the warm-up tells (a draw moves a generator), or a
            capture that meets a random op it did not watch for, and then captures again.

    With ``random_ops="graph"`` a function that drew nothing is captured without the
    op watch (the capture costs no Python call per op); should a random op come
    anyway, the capture is refused by torch and made again with the watch.
    """

    def __init__(
        self,
        fn: Callable,
        args: tuple,
        kwargs: dict,
        options: CaptureOptions | None = None,
        *,
        debug: bool | None = None,
        pool: torch.cuda.MemPool | None = None,
        warmup: int = 1,
        warn: bool = True,
        draws_random_numbers: bool | None = None,
    ):
        if not callable(fn):
            raise TypeError(f"expected a callable to capture, got {type(fn).__name__}")
        warmup = parse_warmup(warmup, allow_auto=False)
        if pool is not None:
            require_pool(pool)
        tensors = _tensors_to_refill(fn, args, kwargs)
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.debug = runtime.debug_requested(debug)
        self.options = options or CaptureOptions()
        if self.debug:  # the whole function is one eager break, whatever the breaks mode
            self.options = dataclasses.replace(self.options, breaks="eager")
        self.output: Any = None
        self.draws_random_numbers = draws_random_numbers
        self.graph: BreakableCUDAGraph | None = None
        self._write_eager_result = None
        reason = runtime.eager_fallback_reason()
        if reason is not None:
            if warn:
                runtime.warn_user(f"breakgraph: {reason}; {function_name(fn)} runs eagerly on every replay")
            self.output = fn(*args, **kwargs)
        else:
            self.graph = BreakableCUDAGraph(pool=pool, debug=self.debug)
            self._capture(warmup, _device_of(tensors))
        try:
            flat = check_output(function_name(fn), self.output)
        except BaseException:
            if self.graph is not None:
                self.graph.reset()  # refused: its segments and buffers go now, not at a collection
            raise
        if self.graph is None:
            # Tensors only, as a graph's replay refreshes them: values stay the first call's.
            self._write_eager_result = make_writer(function_name(fn), self.output, flat, replace_values=False)

    def _capture(self, warmup: int, device: torch.device) -> None:
        fn, args, kwargs = self.fn, self.args, self.kwargs
        with runtime.claim_capture_stream(device) as stream:
            # Lazy library initialisation must not happen inside the capture: warm up what it records.
            with context.full_graph_warmup() if self.options.breaks == "inline" else contextlib.nullcontext():
                for _ in range(warmup):
                    before = rng.draw_counts(device, self.options.generators)
                    runtime.run_on_stream(stream, lambda: fn(*args, **kwargs))
                    drew = rng.draw_counts(device, self.options.generators) != before
                    self.draws_random_numbers = bool(self.draws_random_numbers) or drew
            # Debug mode: the whole function is one eager break, replayed through the same path.
            target = eager_on_graph(fn) if self.debug else fn
            unwatched = self.options.random_ops == "graph" and not self.draws_random_numbers
            try:
                self._capture_on(stream, target, unwatched)
            except UncapturableOpError as error:
                if not (unwatched and is_random_op_refusal(error.__cause__)):
                    raise
                self.draws_random_numbers = True  # a random op the warm-up did not meet
                self._capture_on(stream, target, unwatched=False)

    def _capture_on(self, stream: torch.cuda.Stream, target: Callable, unwatched: bool) -> None:
        with context.skip_op_watch() if unwatched else contextlib.nullcontext():
            with BreakableCUDAGraphCapture(self.graph, stream=stream, options=self.options):
                self.output = target(*self.args, **self.kwargs)

    @property
    def eager(self) -> bool:
        """True when this callable runs ``fn`` eagerly instead of replaying a graph."""
        return self.graph is None

    def replay(self) -> Any:
        """Re-run ``fn`` on the static arguments (a graph replay, or an eager call without a
        GPU) and return its output object, refreshed in place."""
        if self.graph is None:
            result = self.fn(*self.args, **self.kwargs)
            with torch.no_grad():  # a copy that autograd recorded would chain every replay to the last
                self._write_eager_result(result)
        else:
            self.graph.replay()
        return self.output

    def __call__(self, *args, **kwargs) -> Any:
        """:meth:`replay`; it takes no inputs: the graph reads the static arguments it was captured on."""
        if args or kwargs:
            raise TypeError(
                f"a graphed callable takes no arguments: it replays {function_name(self.fn)} on the static arguments it "
                "was captured with. Copy new values into those tensors in place (x.copy_(new)), then call "
                "step() or step.replay(); for batches whose size changes, use bg.GraphRunner"
            )
        return self.replay()


def _tensors_to_refill(fn: Callable, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors in the static arguments (in dataclasses and objects too); none where there
    are no static arguments. Refuses arguments none of which holds a tensor: a replay re-runs
    the capture on the same arguments, so nothing could be refilled between replays."""
    if not args and not kwargs:  # fn reads its tensors from a closure or a module: refilled there
        return []
    leaves, _spec = trees.flatten((args, kwargs), objects=True)
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    if not tensors:
        raise TypeError(
            f"none of {function_name(fn)}'s static arguments holds a tensor ({', '.join(type(leaf).__name__ for leaf in leaves)}), "
            "so there is nothing to refill between replays: every replay would return the capture's result. Pass "
            "the tensors it reads as static arguments and copy new values into them in place; bind other "
            "arguments first with functools.partial(fn, ...)"
        )
    return tensors


def _device_of(tensors: list[torch.Tensor]) -> torch.device:
    """The device of the first CUDA tensor, else the current device."""
    for tensor in tensors:
        if tensor.is_cuda:
            return tensor.device
    return torch.device("cuda", torch.cuda.current_device())


_GRAPHED_OWN = ("options", "debug", "pool", "warmup")


def split_keywords(fn: Callable, keywords: dict) -> tuple[dict, dict]:
    """``graphed``'s keyword arguments as (capture options, ``fn``'s static keyword arguments).

    A name that ``fn`` does not declare and that is close to one of
    breakgraph's options is refused as a likely misspelling, even where
    ``fn`` takes ``**kwargs``: passed on, it would be swallowed silently.
    So is an option's name that ``fn`` declares: it could be meant for either.
    """
    if not keywords:
        return {}, {}
    known = CaptureOptions.names()
    capture = {name: value for name, value in keywords.items() if name in known}
    static = {name: value for name, value in keywords.items() if name not in known}
    declared = _declared_parameters(fn)
    for name in capture:
        if name in declared:
            raise TypeError(
                f"graphed() got {name}=, which is both an option of breakgraph's capture and an argument of "
                f"{function_name(fn)}: give the option as options=bg.CaptureOptions({name}=...), and bind "
                f"{function_name(fn)}'s own first: graphed(functools.partial(fn, {name}=...), ...)"
            )
    for name in static:
        guess = None if name in declared else near_miss(name, known + _GRAPHED_OWN)
        if guess is not None:
            raise TypeError(
                f"graphed() got {name}=, which {function_name(fn)} does not declare and which looks like "
                f"breakgraph's option {guess!r}. Spell the option {guess}=; if {name} is an argument of "
                f"{function_name(fn)} itself, bind it first: graphed(functools.partial(fn, {name}=...), ...)"
            )
    return capture, static


def _declared_parameters(fn: Callable) -> frozenset[str]:
    """The names ``fn``'s signature spells out (not those a ``**kwargs`` would swallow)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: nothing is declared
        return frozenset()
    return frozenset(p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))


def graphed(
    fn: Callable,
    *static_args: Any,
    options: CaptureOptions | None = None,
    debug: bool | None = None,
    pool: torch.cuda.MemPool | None = None,
    warmup: int = 1,
    **keywords: Any,
) -> GraphedCallable:
    """Capture ``fn(*static_args, **static_kwargs)`` as a breakable graph.

    Without a GPU, or with ``BREAKGRAPH_DISABLE=1``, replay calls ``fn``
    eagerly (one warning). Replay returns the capture-time output, refreshed
    in place; a Python number in it stays the capture's (a warning says so).

    Arguments:
        fn (callable): the function to capture.
        *static_args: its static positional arguments (tensors keep their addresses).
        options (CaptureOptions, optional): how the capture treats random ops,
            breaks and barriers. Default: ``CaptureOptions()``.
        debug (bool, optional): make the whole function one eager break replayed
            through the same code path, with debug checks. None (default):
            ``BREAKGRAPH_DEBUG=1`` decides.
        pool (torch.cuda.MemPool, optional): a pool to share with other graphs.
        warmup (int, optional): eager runs on the capture stream before the
            capture, since lazy library initialisation must not happen inside
            it (default 1; pass 0 if ``fn`` has side effects that must not
            repeat). Before a full graph (``breaks="inline"``) breaks run their
            capturable variants.
        **keywords: the fields of :class:`~breakgraph.CaptureOptions` by name
            (``random_ops``, ``breaks``, ...), set on top of ``options``; every
            other name is a static keyword argument of ``fn``. A name close to
            an option's that ``fn`` does not declare is refused as a misspelling.
    """
    capture, static_kwargs = split_keywords(fn, keywords)
    options = CaptureOptions.build("graphed", options, capture)
    return GraphedCallable(fn, static_args, static_kwargs, options, debug=debug, pool=pool, warmup=warmup)
