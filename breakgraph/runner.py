"""GraphRunner: one breakable graph per batch size, live batches dispatched to the smallest that fits."""

from __future__ import annotations

import bisect
import logging
import time
import warnings
from typing import Any, Callable, Hashable, Sequence

import torch

from breakgraph.capture import BreakableCUDAGraph, BreakableCUDAGraphCapture, _default_capture_stream, _parse_random_ops
from breakgraph.config import debug_requested
from breakgraph.debug import format_table
from breakgraph.eager import eager_on_graph
from breakgraph.graphed import eager_fallback_reason
from breakgraph.pool import new_pool, pool_bytes

log = logging.getLogger("breakgraph.runner")


def default_capture_sizes(max_size: int) -> list[int]:
    """The engines' habit: 1, 2, 4, 8, then every multiple of 8 up to ``max_size`` (itself included)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_size] + list(range(16, max_size + 1, 8))
    if max_size not in sizes:
        sizes.append(max_size)
    return sizes


def validate_capture_sizes(sizes: Sequence[int], max_size: int) -> list[int]:
    """Check that ``sizes`` is a strictly increasing list of positive ints no larger than ``max_size``."""
    sizes = list(sizes)
    if not sizes:
        raise ValueError("capture_sizes is empty: give at least one batch size")
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(f"capture_sizes must hold ints, got {size!r}")
        if size <= 0:
            raise ValueError(f"capture_sizes must be positive, got {size}")
        if size > max_size:
            raise ValueError(f"capture size {size} exceeds the static buffers' batch dimension {max_size}")
    for smaller, larger in zip(sizes, sizes[1:]):
        if smaller == larger:
            raise ValueError(f"capture_sizes has {smaller} twice")
        if smaller > larger:
            raise ValueError(f"capture_sizes must be sorted ascending: {smaller} comes before {larger}")
    return sizes


def choose_size(sizes: Sequence[int], n: int) -> int | None:
    """The smallest captured size that holds ``n`` rows, or None above the largest."""
    index = bisect.bisect_left(sizes, n)
    return sizes[index] if index < len(sizes) else None


def _leaves(inputs) -> list[torch.Tensor]:
    if isinstance(inputs, torch.Tensor):
        return [inputs]
    if isinstance(inputs, dict):
        return list(inputs.values())
    return list(inputs)


def _call(fn: Callable, inputs, extra: dict):
    if isinstance(inputs, torch.Tensor):
        return fn(inputs, **extra)
    if isinstance(inputs, dict):
        return fn(**inputs, **extra)
    return fn(*inputs, **extra)


def _map(inputs, transform):
    if isinstance(inputs, torch.Tensor):
        return transform(inputs)
    if isinstance(inputs, dict):
        return {key: transform(value) for key, value in inputs.items()}
    return type(inputs)(transform(value) for value in inputs)


def _slice_output(output, size: int, n: int, clone: bool):
    """Rows ``[:n]`` of every output tensor whose dimension 0 is the batch."""
    if isinstance(output, torch.Tensor):
        if output.dim() > 0 and output.shape[0] == size:
            output = output[:n]
        return output.clone() if clone else output
    if isinstance(output, (list, tuple)):
        items = [_slice_output(item, size, n, clone) for item in output]
        return type(output)(*items) if hasattr(output, "_fields") else type(output)(items)
    if isinstance(output, dict):
        return {key: _slice_output(value, size, n, clone) for key, value in output.items()}
    return output


class GraphRunner:
    """Capture ``fn`` once per batch size and dispatch live batches to those graphs.

    ``static_inputs`` are max-size buffers (a tensor, or a tuple/list/dict of
    tensors) whose dimension 0 is the batch; ``fn`` is called on their views
    ``[:size]`` (positionally, or by keyword for a dict). A live batch of
    ``n`` rows is copied in, padded with ``pad_value`` up to the smallest
    captured size ``>= n``, replayed, and the output is returned sliced to
    ``n`` rows: views of static buffers, valid until the next call, unless
    ``clone=True``. Above the largest size, ``fn`` runs eagerly.

    ``keys`` separates graph variants beside the batch size (as vLLM's
    ``BatchDescriptor`` separates uniform decode from mixed batches): one
    graph per key and size, ``fn`` receiving ``key=`` as a keyword. Then
    ``key_fn(*inputs)`` returns the keys that may serve a batch, most
    preferred first; the first key with a captured size that fits wins.
    ``capture_sizes`` may then be a dict giving each key its own sizes.
    ``random_ops`` is as for :class:`BreakableCUDAGraphCapture`: "error"
    makes start-up capture faster for models with no random ops.
    """

    def __init__(
        self,
        fn: Callable,
        static_inputs,
        capture_sizes: Sequence[int] | dict[Hashable, Sequence[int]] | None = None,
        *,
        keys: Sequence[Hashable] | None = None,
        key_fn: Callable[..., Sequence[Hashable]] | None = None,
        pad_value: float = 0,
        clone: bool = False,
        warmup: int = 1,
        progress: bool = True,
        debug: bool | None = None,
        random_ops: str = "break",
    ):
        leaves = _leaves(static_inputs)
        if not leaves or not all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in leaves):
            raise TypeError("static_inputs must be a tensor or a tuple/list/dict of tensors with a batch dimension 0")
        self.max_size = leaves[0].shape[0]
        if any(t.shape[0] != self.max_size for t in leaves):
            raise ValueError(f"static inputs disagree on the batch dimension: {[tuple(t.shape) for t in leaves]}")
        if (keys is None) != (key_fn is None):
            raise ValueError("give keys and key_fn together, or neither")
        self.fn = fn
        self.static_inputs = static_inputs
        self.keys = list(keys) if keys is not None else [None]
        if capture_sizes is None:
            capture_sizes = default_capture_sizes(self.max_size)
        if not isinstance(capture_sizes, dict):
            capture_sizes = {key: capture_sizes for key in self.keys}
        if set(capture_sizes) != set(self.keys):
            raise ValueError(f"capture_sizes has keys {list(capture_sizes)}, expected {self.keys}")
        self.sizes_by_key = {key: validate_capture_sizes(capture_sizes[key], self.max_size) for key in self.keys}
        self.key_fn = key_fn
        self.pad_value = pad_value
        self.clone = clone
        self.warmup = warmup
        self.progress = progress
        self.debug = debug_requested(debug)
        _parse_random_ops(random_ops)
        self.random_ops = random_ops
        self.pool = None
        self._graphs: dict[tuple[Hashable, int], tuple[BreakableCUDAGraph, Any]] = {}
        self._capture_seconds: dict[tuple[Hashable, int], float] = {}
        self._warned_eager = False
        self.eager_reason = eager_fallback_reason()
        if self.eager_reason is not None:
            warnings.warn(f"breakgraph: {self.eager_reason}; GraphRunner runs {getattr(fn, '__qualname__', fn)} eagerly", stacklevel=2)

    # -- capture ----------------------------------------------------------------------
    def capture(self) -> "GraphRunner":
        """Capture every (key, size), largest size first, into one shared memory pool."""
        if self.eager_reason is not None:
            return self
        self.pool = self.pool or new_pool()
        device = _leaves(self.static_inputs)[0].device
        stream = _default_capture_stream(device)
        work = sorted(
            ((key, size) for key, sizes in self.sizes_by_key.items() for size in sizes), key=lambda item: -item[1]
        )
        if self.progress:
            from tqdm import tqdm

            work = tqdm(work, desc="breakgraph: capturing", unit="graph")
        for key, size in work:
            if (key, size) in self._graphs:
                continue
            started = time.perf_counter()
            views = _map(self.static_inputs, lambda t: t[:size])
            extra = {} if key is None else {"key": key}
            if self.warmup:
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(self.warmup):
                        _call(self.fn, views, extra)
                torch.cuda.current_stream().wait_stream(stream)
            graph = BreakableCUDAGraph(pool=self.pool, debug=self.debug)
            target = eager_on_graph(self.fn) if self.debug else self.fn
            with BreakableCUDAGraphCapture(graph, stream=stream, random_ops=self.random_ops):
                output = _call(target, views, extra)
            self._graphs[(key, size)] = (graph, output)
            self._capture_seconds[(key, size)] = time.perf_counter() - started
        return self

    # -- dispatch ------------------------------------------------------------------------
    def select(self, n: int, candidates: Sequence[Hashable] = (None,)) -> tuple[Hashable, int] | None:
        """The (key, size) graph a batch of ``n`` rows goes to, or None for eager."""
        for key in candidates:
            size = choose_size(self.sizes_by_key.get(key, ()), n)
            if size is not None:
                return key, size
        return None

    def __call__(self, *args, **kwargs):
        inputs = self._live_inputs(args, kwargs)
        n = _leaves(inputs)[0].shape[0]
        self._validate(inputs, n)
        if self.eager_reason is not None:
            return _call(self.fn, inputs, {} if self.key_fn is None else {"key": self._candidates(inputs)[0]})
        if not self._graphs:
            self.capture()
        candidates = self._candidates(inputs)
        chosen = self.select(n, candidates)
        if chosen is None:
            if not self._warned_eager:
                log.debug("batch of %d rows fits no captured size: running eagerly", n)
                self._warned_eager = True
            return _call(self.fn, inputs, {} if self.key_fn is None else {"key": candidates[0]})
        key, size = chosen
        graph, output = self._graphs[(key, size)]
        for static, live in zip(_leaves(self.static_inputs), _leaves(inputs)):
            static[:n].copy_(live)
            if n < size:
                static[n:size].fill_(self.pad_value)
        graph.replay()
        return _slice_output(output, size, n, self.clone)

    def _live_inputs(self, args, kwargs):
        if isinstance(self.static_inputs, dict):
            if args:
                raise TypeError("this runner's static inputs are a dict: pass live inputs by keyword")
            return kwargs
        if kwargs:
            raise TypeError("pass live inputs positionally, in the order of the static inputs")
        if isinstance(self.static_inputs, torch.Tensor):
            if len(args) != 1:
                raise TypeError(f"expected 1 input tensor, got {len(args)}")
            return args[0]
        return type(self.static_inputs)(args) if not hasattr(self.static_inputs, "_fields") else type(self.static_inputs)(*args)

    def _validate(self, inputs, n: int) -> None:
        statics, lives = _leaves(self.static_inputs), _leaves(inputs)
        if isinstance(self.static_inputs, dict) and set(inputs) != set(self.static_inputs):
            raise ValueError(f"expected inputs {sorted(self.static_inputs)}, got {sorted(inputs)}")
        if len(lives) != len(statics):
            raise ValueError(f"expected {len(statics)} inputs, got {len(lives)}")
        if n == 0:
            raise ValueError("empty batch: n = 0 rows; skip the call instead")
        for index, (static, live) in enumerate(zip(statics, lives)):
            if not isinstance(live, torch.Tensor):
                raise TypeError(f"input {index}: expected a tensor, got {type(live).__name__}")
            if live.shape[0] != n:
                raise ValueError(f"input {index}: {live.shape[0]} rows, but input 0 has {n}")
            if live.shape[1:] != static.shape[1:]:
                raise ValueError(
                    f"input {index}: shape {tuple(live.shape)} does not fit static buffer {tuple(static.shape)} "
                    "(only dimension 0, the batch, may differ)"
                )
            if live.dtype != static.dtype:
                raise ValueError(f"input {index}: dtype {live.dtype}, static buffer has {static.dtype}")

    def _candidates(self, inputs) -> list[Hashable]:
        if self.key_fn is None:
            return [None]
        keys = _call(self.key_fn, inputs, {})
        return list(keys) if isinstance(keys, (list, tuple)) else [keys]

    # -- report --------------------------------------------------------------------------
    def report(self, print_table: bool = True) -> dict:
        """Sizes captured, segments per size, capture time per size, pool bytes."""
        rows = [
            {
                "key": "" if key is None else key,
                "size": size,
                "graphs": graph.num_graphs,
                "eager_breaks": graph.num_eager_breaks,
                "capture_ms": round(self._capture_seconds[(key, size)] * 1000, 2),
            }
            for (key, size), (graph, _out) in sorted(self._graphs.items(), key=lambda item: (str(item[0][0]), item[0][1]))
        ]
        total_bytes = pool_bytes(self.pool) if self.pool is not None else 0
        report = {"rows": rows, "pool_bytes": total_bytes, "eager_reason": self.eager_reason}
        if print_table:
            if self.eager_reason is not None:
                print(f"GraphRunner: eager ({self.eager_reason})")
            else:
                print(format_table(rows, ["key", "size", "graphs", "eager_breaks", "capture_ms"]))
                print(f"{len(rows)} graphs captured, pool holds {total_bytes / 2**20:.1f} MiB")
        return report
