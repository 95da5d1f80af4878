"""GraphRunner: one breakable graph per batch size, live batches dispatched to the smallest that fits."""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from typing import Callable, Hashable, Sequence

import torch

import breakgraph_bindings as bindings
from breakgraph import runtime
from breakgraph.batches import StaticInputs, live_rows
from breakgraph.estimate import MemoryEstimate, Probe, extrapolate, probe_sizes
from breakgraph.tables import format_table
from breakgraph.graph import BreakableCUDAGraph, check_replay_hooks
from breakgraph.graphed import GraphedCallable
from breakgraph.pool import PoolUsage, new_pool, pool_bytes
from breakgraph.sharing import Refusal, share_executables
from breakgraph.dispatch import UncapturableOpError, is_capture_violation
from breakgraph.options import CaptureOptions, parse_modes, parse_warmup
from breakgraph.sizes import choose_size, default_capture_sizes, validate_capture_sizes

log = logging.getLogger("breakgraph.runner")


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

    ``warmup="auto"`` (default) runs ``fn`` eagerly once per key, at the
    first size captured for it, and captures every other size directly; a
    size whose capture fails the way lazy initialisation inside a capture
    fails (a CUDA call that capture forbids) is warmed up once and captured
    again. An int runs ``fn`` that many times before every size's capture.
    ``lazy=True`` captures nothing up front: each (key, size) is captured
    the first time a batch needs it.

    ``modes`` gives each key its graph mode, as vLLM's ``CUDAGraphMode``
    does (one mode for all keys, or a dict): "breakable" (default; breaks
    run eagerly between segments, vLLM's PIECEWISE), "full" (one graph per
    size, each break recording its capturable variant, vLLM's FULL) or
    "none" (no graphs: such batches run eagerly). Uniform decode batches to
    "full" and mixed batches to "breakable" is vLLM's FULL_AND_PIECEWISE.
    ``random_ops``, ``generators`` and ``barrier_fn`` are as for
    :class:`BreakableCUDAGraphCapture`; ``before_replay`` and
    ``after_replay`` are called around every replay (not around eager runs).

    ``on_capture_error="eager"`` serves a size whose capture fails eagerly,
    on the same padded static buffers, after logging the reason once, while
    the other sizes keep their graphs; ``report()`` lists it. The default,
    "raise", propagates the error.

    ``share_executables=True`` keeps one executable per segment and topology
    for all the sizes of a key (``cudaGraphExecUpdate``), rather than one per
    segment per size: less
    device memory, and a replay whose size differs from the previous one's
    first updates each shared segment. Memory an engine can plan around:
    :meth:`estimate_memory` (before capturing), :meth:`memory`,
    :meth:`release` and :meth:`restore`.

    ``measure_memory=True`` measures the device memory each executable takes
    as it is instantiated (``cudaMemGetInfo`` around it, and an upload so the
    driver's whole share is counted), which :meth:`memory` and :meth:`report`
    then count. It is off by default: it made start-up 11-25 % slower on an
    H100; unmeasured executables are uploaded by their first replay.
    :meth:`estimate_memory` measures its probes either way.
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
        warmup: int | str = "auto",
        lazy: bool = False,
        progress: bool = True,
        debug: bool | None = None,
        modes: str | dict[Hashable, str] = "breakable",
        random_ops: str = "graph",
        generators=(),
        barrier_fn=None,
        before_replay=None,
        after_replay=None,
        on_capture_error: str = "raise",
        share_executables: bool = False,
        measure_memory: bool = False,
    ):
        if not callable(fn):
            raise TypeError(f"GraphRunner needs a callable to capture, got {type(fn).__name__}")
        self.inputs = StaticInputs(static_inputs)
        self.max_size = self.inputs.max_size
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
        self.modes = parse_modes(modes, self.keys)
        self.sizes_by_key = {
            key: validate_capture_sizes(capture_sizes[key], self.max_size) if self.modes[key] != "none" else []
            for key in self.keys
        }
        self.warmup = parse_warmup(warmup, allow_auto=True)
        self.key_fn = key_fn
        self.pad_value = pad_value
        self.clone = clone
        self.lazy = lazy
        self.progress = progress
        self.debug = runtime.debug_requested(debug)
        self.options = CaptureOptions.parse(
            random_ops=random_ops, generators=generators, barrier_fn=barrier_fn, measure_memory=measure_memory
        )
        check_replay_hooks(before_replay, after_replay)
        self.replay_hooks = {"before": before_replay, "after": after_replay}
        if on_capture_error not in ("raise", "eager"):
            raise ValueError(f"on_capture_error must be 'raise' or 'eager', got {on_capture_error!r}")
        self.on_capture_error = on_capture_error
        if not isinstance(share_executables, bool):
            raise TypeError(f"share_executables must be True or False, got {share_executables!r}")
        self.share_executables = share_executables
        self.refusals: dict[tuple[Hashable, int], list[Refusal]] = {}
        self._released: str | None = None  # "executables" or "everything" while released
        self._while_released = "eager"
        self._failed: dict[tuple[Hashable, int], str] = {}
        self.pool = None
        self._graphed: dict[tuple[Hashable, int], GraphedCallable] = {}
        self._capture_seconds: dict[tuple[Hashable, int], float] = {}
        self._warmed_up: set[tuple[Hashable, int]] = set()
        self._first_use_seconds: dict[tuple[Hashable, int], float] = {}
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
        """Capture every (key, size), largest size first, into one shared memory pool.
        With ``lazy=True`` this only prepares the pool: sizes are captured on first use."""
        if self.eager_reason is not None:
            return self
        if self.pool is None:
            self.pool = new_pool()
        if self.lazy:
            return self
        work = sorted(
            ((key, size) for key, sizes in self.sizes_by_key.items() for size in sizes), key=lambda item: -item[1]
        )
        if self.progress:
            from tqdm import tqdm

            work = tqdm(work, desc="breakgraph: capturing", unit="graph")
        for key, size in work:
            if (key, size) not in self._graphed and (key, size) not in self._failed:
                self._capture_one(key, size)
        self._share()
        return self

    def _share(self) -> None:
        """With ``share_executables``, let every key's graphs launch one executable per
        segment and topology where CUDA can update them (see :mod:`breakgraph.sharing`)."""
        if not self.share_executables:
            return
        for key in self.keys:
            captured = [(size, graphed.graph) for (k, size), graphed in self._graphed.items() if k == key]
            refusals = share_executables([graph for _size, graph in captured])  # refused ones are tried again
            self.refusals = {key_size: refused for key_size, refused in self.refusals.items() if key_size[0] != key}
            for refusal in refusals:
                self.refusals.setdefault((key, captured[refusal.graph][0]), []).append(refusal)

    def _capture_one(self, key: Hashable, size: int, measure: bool | None = None) -> GraphedCallable | None:
        """Capture (key, size), measuring its executables' memory if ``measure`` (default: the
        runner's ``measure_memory``); with ``on_capture_error="eager"`` a failure is logged
        and remembered, and the size is served eagerly (None)."""
        started = time.perf_counter()
        measure = self.options.measure_memory if measure is None else measure
        try:
            graphed = self._warm_up_and_capture(key, size, measure)
        except Exception as error:
            if self.on_capture_error == "raise":
                raise
            self._failed[(key, size)] = f"{type(error).__name__}: {error}"
            log.warning("capture of size %d (key %r) failed; serving it eagerly: %s", size, key, self._failed[(key, size)])
            return None
        self._graphed[(key, size)] = graphed
        self._capture_seconds[(key, size)] = time.perf_counter() - started
        return graphed

    def _warm_up_and_capture(self, key: Hashable, size: int, measure: bool) -> GraphedCallable:
        if self.warmup == "auto":
            first_of_key = not any(done == key for done, _size in self._graphed)
            try:
                graphed = self._graphed_at(key, size, 1 if first_of_key else 0, measure)
            except Exception as error:
                if first_of_key or not (isinstance(error, UncapturableOpError) or is_capture_violation(error)):
                    raise
                log.info("capture of size %d failed without warm-up (%s): warming up and capturing again", size, error)
                graphed = self._graphed_at(key, size, 1, measure)
                first_of_key = True
            if first_of_key:
                self._warmed_up.add((key, size))
        else:
            graphed = self._graphed_at(key, size, self.warmup, measure)
            if self.warmup:
                self._warmed_up.add((key, size))
        return graphed

    def _graphed_at(self, key: Hashable, size: int, warmup: int, measure: bool) -> GraphedCallable:
        args, kwargs = self._arguments(self.inputs.views(size), key)
        breaks = "inline" if self.modes[key] == "full" else "eager"
        options = dataclasses.replace(self.options, breaks=breaks, measure_memory=measure)
        graphed = GraphedCallable(self.fn, args, kwargs, options, debug=self.debug, pool=self.pool, warmup=warmup, warn=False)
        graphed.graph.set_replay_hooks(**self.replay_hooks)
        return graphed

    # -- dispatch ------------------------------------------------------------------------
    def select(self, n: int, candidates: Sequence[Hashable] = (None,)) -> tuple[Hashable, int] | None:
        """The (key, size) graph a batch of ``n`` rows goes to, or None for eager."""
        for key in candidates:
            size = choose_size(self.sizes_by_key.get(key, ()), n)
            if size is not None:
                return key, size
        return None

    def __call__(self, *args, **kwargs):
        inputs = self.inputs.live(args, kwargs)
        live = self.inputs.check(inputs)
        n = live[0].shape[0]
        candidates = self._candidates(inputs)
        if self._released is not None:
            if self._while_released == "raise":
                raise RuntimeError("this GraphRunner's graphs are released (runner.release()): call runner.restore() first")
            return self._run_eagerly(inputs, candidates[0])
        if self.eager_reason is None and self.pool is None:
            self.capture()
        chosen = None if self.eager_reason is not None else self.select(n, candidates)
        if chosen is None:
            if self.eager_reason is None and not self._logged_eager:
                log.debug("batch of %d rows fits no captured size: running eagerly", n)
                self._logged_eager = True
            return self._run_eagerly(inputs, candidates[0])
        key, size = chosen
        self.inputs.fill(live, size, self.pad_value)
        graphed = self._graphed.get((key, size))
        if graphed is None and (key, size) not in self._failed:  # lazy: captured on first use, and that use timed
            started = time.perf_counter()
            graphed = self._capture_one(key, size)
            if graphed is not None:
                self._share()
                graphed.replay()
                torch.cuda.current_stream().synchronize()
                self._first_use_seconds[(key, size)] = time.perf_counter() - started
        if graphed is None:  # its capture failed: the same padded buffers, eagerly
            output = self._run_eagerly(self.inputs.views(size), key)
        else:
            output = graphed.replay()
        return live_rows(output, size, n, self.clone)

    def _arguments(self, inputs, key: Hashable) -> tuple[tuple, dict]:
        """How ``fn`` is called on ``inputs``: shaped like the static inputs, and ``key=`` when
        the runner has keys (``key`` is None otherwise)."""
        return self.inputs.arguments(inputs, {} if key is None else {"key": key})

    def _run_eagerly(self, inputs, key: Hashable):
        args, kwargs = self._arguments(inputs, key)
        return self.fn(*args, **kwargs)

    def _candidates(self, inputs) -> list[Hashable]:
        if self.key_fn is None:
            return [None]
        key_args, key_kwargs = self._arguments(inputs, None)
        keys = self.key_fn(*key_args, **key_kwargs)
        return list(keys) if isinstance(keys, (list, tuple)) else [keys]

    def __del__(self) -> None:
        # The shared pool may outlive every graph here: never let it die inside another thread's capture.
        if runtime is not None:  # runtime is None at interpreter exit
            runtime.release_after_captures(self, "pool")

    # -- memory ----------------------------------------------------------------------------
    def memory(self) -> dict:
        """Device memory the graphs hold now: the shared pool (reserved, allocated or cached)
        and the executables (measured with ``cudaMemGetInfo`` at instantiation). The
        executables' bytes, and so the total, are None where some graph's were not
        measured (``measure_memory=False``, the default)."""
        pool = pool_bytes(self.pool) if self.pool is not None else 0
        measured = [graphed.graph.executable_bytes for graphed in self._graphed.values()]
        executables = None if None in measured else sum(measured)
        total = None if executables is None else pool + executables
        return {"pool_bytes": pool, "executable_bytes": executables, "total_bytes": total}

    def estimate_memory(self, probes: int = 5) -> MemoryEstimate:
        """Capture a few sizes of every key (the largest, the smallest and ``probes - 2``
        between; they stay captured, and :meth:`capture` captures the rest) and estimate
        what the graphs of all sizes will hold (pool and executables: the probes measure
        their executables whatever ``measure_memory`` says). Call it before :meth:`capture`."""
        runtime.require_cuda("GraphRunner.estimate_memory")
        if self._graphed or self._failed:
            raise RuntimeError("estimate_memory() captures its probes into an empty runner: call it before capture()")
        started = time.perf_counter()
        if self.pool is None:
            self.pool = new_pool()
        probes_by_key = {}
        work = sorted(((key, size) for key in self.keys for size in probe_sizes(self.sizes_by_key[key], probes)), key=lambda item: -item[1])
        usage = PoolUsage.of(self.pool)
        for key, size in work:
            kept_before = usage.allocated_bytes
            graphed = self._capture_one(key, size, measure=True)
            usage = PoolUsage.of(self.pool)
            if graphed is not None:
                kept = usage.allocated_bytes - kept_before
                probe = Probe(size, kept, graphed.graph.executable_bytes, usage.reserved_bytes)
                probes_by_key.setdefault(key, []).append(probe)
        seconds = time.perf_counter() - started
        return extrapolate(self.sizes_by_key, probes_by_key, usage.reserved_bytes, seconds, usage.allocated_bytes)

    def release(self, keep_graphs: bool = False, while_released: str = "eager") -> dict:
        """Give the graphs' device memory back, as an engine going to sleep does.

        ``keep_graphs=False`` frees the pool and every executable; :meth:`restore`
        captures again. ``keep_graphs=True`` frees the executables only and keeps the
        captured graphs and the pool; :meth:`restore` instantiates them again. Until
        then calls run ``fn`` eagerly (``while_released="eager"``) or raise ("raise").
        Outputs of earlier calls must not be used after a release. Returns the bytes
        freed (``cudaMemGetInfo`` before and after) and the seconds it took."""
        if while_released not in ("eager", "raise"):
            raise ValueError(f"while_released must be 'eager' or 'raise', got {while_released!r}")
        if self._released is not None:
            raise RuntimeError("this GraphRunner is released already: call restore() first")
        runtime.require_cuda("GraphRunner.release")
        taken_bytes, seconds = _measured(self._release_executables if keep_graphs else self._release_everything)
        self._released, self._while_released = ("executables" if keep_graphs else "everything"), while_released
        return {"freed_bytes": -taken_bytes, "seconds": seconds}

    def _release_executables(self) -> None:
        for graphed in self._graphed.values():
            graphed.graph.release_executables()

    def _release_everything(self) -> None:
        self._graphed.clear()
        self.refusals.clear()
        runtime.release_after_captures(self, "pool")  # a MemPool gives its cached blocks back as it dies
        self.pool = None

    def restore(self) -> dict:
        """Bring back what :meth:`release` gave up: instantiate the kept graphs again, or
        capture again; replays then match those before the release. Returns the device
        memory taken (``cudaMemGetInfo``) and the seconds it took."""
        if self._released is None:
            raise RuntimeError("this GraphRunner is not released: nothing to restore")
        taken_bytes, seconds = _measured(self._restore_executables if self._released == "executables" else self._capture_again)
        return {"taken_bytes": taken_bytes, "seconds": seconds}

    def _restore_executables(self) -> None:
        for graphed in self._graphed.values():
            graphed.graph.restore_executables()
        self._released = None
        self._share()

    def _capture_again(self) -> None:
        self._released = None
        self.capture()

    # -- report --------------------------------------------------------------------------
    def report(self, print_table: bool = True) -> dict:
        """Sizes captured, segments per size, capture time per size (and whether it needed a
        warm-up run), the first-use latency of sizes captured lazily, pool bytes, and the
        executables' memory where it was measured (``executable_kib`` is "" and
        ``executable_bytes`` None where not)."""
        rows = [
            {
                "key": "" if key is None else key,
                "mode": self.modes[key],
                "size": size,
                "graphs": graphed.graph.num_graphs,
                "eager_breaks": graphed.graph.num_eager_breaks,
                "executable_kib": _kib(graphed.graph.executable_bytes),
                "shared_segments": sum(1 for segment in graphed.graph.segments if segment.shared is not None),
                "capture_ms": round(self._capture_seconds[(key, size)] * 1000, 2),
                "warmed_up": (key, size) in self._warmed_up,
                "first_use_ms": round(self._first_use_seconds[(key, size)] * 1000, 2)
                if (key, size) in self._first_use_seconds
                else "",
            }
            for (key, size), graphed in sorted(self._graphed.items(), key=lambda item: (str(item[0][0]), item[0][1]))
        ]
        failed = [
            {"key": "" if key is None else key, "mode": self.modes[key], "size": size, "reason": reason}
            for (key, size), reason in sorted(self._failed.items(), key=lambda item: (str(item[0][0]), item[0][1]))
        ]
        memory = self.memory()
        report = {"rows": rows, "failed": failed, "eager_reason": self.eager_reason} | memory
        if print_table:
            if self.eager_reason is not None:
                print(f"GraphRunner: eager ({self.eager_reason})")
            else:
                columns = ["key", "mode", "size", "graphs", "eager_breaks", "capture_ms", "warmed_up", "executable_kib"]
                columns += ["shared_segments"] if self.share_executables else []
                print(format_table(rows, columns + (["first_use_ms"] if self._first_use_seconds else [])))
                held = memory["executable_bytes"]
                executables = (
                    f"executables {held / 2**20:.1f} MiB"
                    if held is not None
                    else "executables not measured (GraphRunner(measure_memory=True) measures them)"
                )
                print(f"{len(rows)} graphs captured, pool holds {memory['pool_bytes'] / 2**20:.1f} MiB, {executables}")
                for row in failed:
                    print(f"size {row['size']} (key {row['key'] or None}) is served eagerly: its capture failed: {row['reason']}")
        return report


def _kib(nbytes: int | None) -> float | str:
    return "" if nbytes is None else round(nbytes / 1024, 1)


def _measured(action: Callable[[], object]) -> tuple[int, float]:
    """Run ``action`` with the device idle before and after; return the device memory it
    took (``cudaMemGetInfo``, negative when it freed some) and the seconds it took."""
    torch.cuda.synchronize()
    free_before, started = bindings.free_device_memory(), time.perf_counter()
    action()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    return free_before - bindings.free_device_memory(), seconds
