"""GraphRunner: one breakable graph per batch size, live batches dispatched to the smallest that fits."""

from __future__ import annotations

import logging
import time
import warnings
from typing import Callable, Hashable, Sequence

import torch

from breakgraph import runtime, trees
from breakgraph.tables import format_table
from breakgraph.graph import BreakableCUDAGraph
from breakgraph.graphed import GraphedCallable
from breakgraph.pool import new_pool, pool_bytes
from breakgraph.recorder import parse_random_ops
from breakgraph.sizes import choose_size, default_capture_sizes, validate_capture_sizes

log = logging.getLogger("breakgraph.runner")


def _arguments(inputs, extra: dict) -> tuple[tuple, dict]:
    """How ``fn`` is called on ``inputs``: a tensor or a tuple/list positionally, a dict by keyword."""
    if isinstance(inputs, torch.Tensor):
        return (inputs,), extra
    if isinstance(inputs, dict):
        return (), {**inputs, **extra}
    return tuple(inputs), extra


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
        if not callable(fn):
            raise TypeError(f"GraphRunner needs a callable to capture, got {type(fn).__name__}")
        leaves, self._spec = trees.flatten(static_inputs, objects=False)
        if not leaves or not all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in leaves):
            raise TypeError("static_inputs must be a tensor or a tuple/list/dict of tensors with a batch dimension 0")
        self.max_size = leaves[0].shape[0]
        if any(t.shape[0] != self.max_size for t in leaves):
            raise ValueError(f"static inputs disagree on the batch dimension: {[tuple(t.shape) for t in leaves]}")
        if (keys is None) != (key_fn is None):
            raise ValueError("give keys and key_fn together, or neither")
        self.fn = fn
        self.static_inputs = static_inputs
        self._static_leaves = leaves
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
        self.debug = runtime.debug_requested(debug)
        self.random_ops = parse_random_ops(random_ops)
        self.pool = None
        self._graphed: dict[tuple[Hashable, int], GraphedCallable] = {}
        self._capture_seconds: dict[tuple[Hashable, int], float] = {}
        self._logged_eager = False
        self.eager_reason = runtime.eager_fallback_reason()
        if self.eager_reason is not None:
            warnings.warn(f"breakgraph: {self.eager_reason}; GraphRunner runs {getattr(fn, '__qualname__', fn)} eagerly", stacklevel=2)

    @property
    def graphs(self) -> dict[tuple[Hashable, int], BreakableCUDAGraph]:
        """The captured graph of every (key, size); key is None without ``keys``."""
        return {key_size: graphed.graph for key_size, graphed in self._graphed.items()}

    # -- capture ----------------------------------------------------------------------
    def capture(self) -> "GraphRunner":
        """Capture every (key, size), largest size first, into one shared memory pool."""
        if self.eager_reason is not None:
            return self
        if self.pool is None:
            self.pool = new_pool()
        work = sorted(
            ((key, size) for key, sizes in self.sizes_by_key.items() for size in sizes), key=lambda item: -item[1]
        )
        if self.progress:
            from tqdm import tqdm

            work = tqdm(work, desc="breakgraph: capturing", unit="graph")
        for key, size in work:
            if (key, size) in self._graphed:
                continue
            started = time.perf_counter()
            views = trees.map_tensors(lambda tensor: tensor[:size], self.static_inputs)
            args, kwargs = _arguments(views, {} if key is None else {"key": key})
            self._graphed[(key, size)] = GraphedCallable(
                self.fn,
                args,
                kwargs,
                debug=self.debug,
                pool=self.pool,
                warmup=self.warmup,
                random_ops=self.random_ops,
                warn=False,
            )
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
        live = self._validate(inputs)
        n = live[0].shape[0]
        if self.eager_reason is None and not self._graphed:
            self.capture()
        candidates = self._candidates(inputs)
        chosen = None if self.eager_reason is not None else self.select(n, candidates)
        if chosen is None:
            if self.eager_reason is None and not self._logged_eager:
                log.debug("batch of %d rows fits no captured size: running eagerly", n)
                self._logged_eager = True
            call_args, call_kwargs = _arguments(inputs, {} if self.key_fn is None else {"key": candidates[0]})
            return self.fn(*call_args, **call_kwargs)
        key, size = chosen
        for static, fresh in zip(self._static_leaves, live):
            static[:n].copy_(fresh)
            if n < size:
                static[n:size].fill_(self.pad_value)
        output = self._graphed[(key, size)].replay()

        def rows(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.dim() > 0 and tensor.shape[0] == size:
                tensor = tensor[:n]
            return tensor.clone() if self.clone else tensor

        return trees.map_tensors(rows, output)

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

    def _validate(self, inputs) -> list[torch.Tensor]:
        """The live input tensors, in the static buffers' order, after checking they fit them."""
        statics = self._static_leaves
        if isinstance(self.static_inputs, dict) and set(inputs) != set(self.static_inputs):
            raise ValueError(f"expected inputs {sorted(self.static_inputs)}, got {sorted(inputs)}")
        lives, _spec = trees.flatten(inputs, objects=False)
        if len(lives) != len(statics):
            raise ValueError(f"expected {len(statics)} inputs, got {len(lives)}")
        for index, (static, live) in enumerate(zip(statics, lives)):
            if not isinstance(live, torch.Tensor):
                raise TypeError(f"input {index}: expected a tensor, got {type(live).__name__}")
        n = lives[0].shape[0] if lives[0].dim() > 0 else None
        if n == 0:
            raise ValueError("empty batch: n = 0 rows; skip the call instead")
        for index, (static, live) in enumerate(zip(statics, lives)):
            if live.dim() == 0 or live.shape[0] != n:
                raise ValueError(f"input {index}: {live.shape[0] if live.dim() else 'no'} rows, but input 0 has {n}")
            if live.shape[1:] != static.shape[1:]:
                raise ValueError(
                    f"input {index}: shape {tuple(live.shape)} does not fit static buffer {tuple(static.shape)} "
                    "(only dimension 0, the batch, may differ)"
                )
            if live.dtype != static.dtype:
                raise ValueError(f"input {index}: dtype {live.dtype}, static buffer has {static.dtype}")
        return lives

    def _candidates(self, inputs) -> list[Hashable]:
        if self.key_fn is None:
            return [None]
        key_args, key_kwargs = _arguments(inputs, {})
        keys = self.key_fn(*key_args, **key_kwargs)
        return list(keys) if isinstance(keys, (list, tuple)) else [keys]

    # -- report --------------------------------------------------------------------------
    def report(self, print_table: bool = True) -> dict:
        """Sizes captured, segments per size, capture time per size, pool bytes."""
        rows = [
            {
                "key": "" if key is None else key,
                "size": size,
                "graphs": graphed.graph.num_graphs,
                "eager_breaks": graphed.graph.num_eager_breaks,
                "capture_ms": round(self._capture_seconds[(key, size)] * 1000, 2),
            }
            for (key, size), graphed in sorted(self._graphed.items(), key=lambda item: (str(item[0][0]), item[0][1]))
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
