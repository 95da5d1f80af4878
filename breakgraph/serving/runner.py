"""GraphRunner: one breakable graph per batch size, live batches dispatched to the smallest that fits."""

from __future__ import annotations

import logging
from typing import Any, Callable, Hashable, Sequence

import torch

from breakgraph import diagnostics
from breakgraph.base import runtime
from breakgraph.serving.batches import StaticInputs, live_rows
from breakgraph.base.checks import require_bool, require_choice, require_count
from breakgraph.base.estimate import MemoryEstimate
from breakgraph.graphs.graph import BreakableCUDAGraph
from breakgraph.serving.memory import RunnerMemory
from breakgraph.base.naming import function_name
from breakgraph.base.options import RunnerOptions, parse_modes
from breakgraph.recording.outputs import check_output
from breakgraph.serving.policy import CapturePolicy
from breakgraph.base.progress import progress_bar
from breakgraph.serving.rank_group import RankGroup
from breakgraph.graphs.sharing import Refusal
from breakgraph.base.sizes import checked_keys, choose_size, known_keys, known_sizes, preferred_keys, sizes_by_key

log = logging.getLogger("breakgraph.runner")


class GraphRunner:
    """Capture ``fn`` once per batch size and dispatch live batches to those graphs.

    ``fn`` is called on views ``[:size]`` of the static inputs (positionally,
    or by keyword for a dict). A live batch of ``n`` rows is copied in, padded
    with ``pad_value`` up to the smallest captured size ``>= n``, replayed,
    and the output is returned sliced to ``n`` rows: views of static buffers,
    valid until the next call, unless ``clone=True``. Above the largest size,
    ``fn`` runs eagerly. Without a GPU, or with ``BREAKGRAPH_DISABLE=1``,
    every call runs ``fn`` eagerly (one warning).

    ``keys`` separates graph variants beside the batch size (as vLLM's
    ``BatchDescriptor`` separates uniform decode from mixed batches): one
    graph per key and size, ``fn`` receiving ``key=`` as a keyword, and
    ``key_fn(*inputs)`` returning the keys that may serve a batch, most
    preferred first; the first key with a captured size that fits wins.

    ``group`` makes the runner one of several tensor-parallel ranks: each
    capture is kept on every rank or on none, every call is padded to the
    largest batch of any rank, and every rank replays the same graph or runs
    eagerly (``ranks`` is then the :class:`~breakgraph.serving.rank_group.RankGroup`
    they agree through). Every rank makes its runner and calls it alike.

    Arguments:
        fn (callable): the step to capture.
        static_inputs (tensor, or tuple/list/dict of tensors): max-size CUDA
            buffers whose dimension 0 is the batch.
        capture_sizes (list of int, or dict of key -> list, optional): the batch
            sizes to capture, ascending. Default: 1, 2, 4, 8, then every
            multiple of 8 up to the buffers' batch dimension.
        keys (list, optional): the graph variants beside the batch size.
        key_fn (callable, optional): ``key_fn(*inputs)`` -> the keys that may
            serve a batch, most preferred first. Given with ``keys`` only.
        options (RunnerOptions, optional): how the runner captures, dispatches
            and serves. Default: ``RunnerOptions()``.
        **runner_options: any field of :class:`~breakgraph.RunnerOptions` by
            name (``lazy=True``, ``modes="full"``, ``pad_value=...``, ...), set on
            top of ``options``.
    """

    def __init__(
        self,
        fn: Callable,
        static_inputs: Any,
        capture_sizes: Sequence[int] | dict[Hashable, Sequence[int]] | None = None,
        *,
        keys: Sequence[Hashable] | None = None,
        key_fn: Callable[..., Sequence[Hashable]] | None = None,
        options: RunnerOptions | None = None,
        **runner_options: Any,
    ):
        if not callable(fn):
            raise TypeError(f"GraphRunner needs a callable to capture, got {type(fn).__name__}")
        self.options = RunnerOptions.build("GraphRunner", options, runner_options)
        self.inputs = StaticInputs(static_inputs)
        self.max_size = self.inputs.max_size
        self.fn = fn
        self.keys, self.key_fn = checked_keys(keys, key_fn)
        self.modes = parse_modes(self.options.modes, self.keys)
        self.sizes_by_key = sizes_by_key(capture_sizes, self.keys, self.modes, self.max_size)
        self.eager_reason = runtime.eager_fallback_reason()
        self.inputs.refuse_meta()
        group = self.options.group
        self.ranks = None if group is None else RankGroup(group, self.options.peer_timeout)
        self._policy = CapturePolicy(fn, self.inputs, self.modes, self.options, self.ranks)
        self._memory = RunnerMemory(self._policy, self.keys, self.options.share_executables, eager=self.eager_reason is not None)
        self._logged_eager = False
        self._output_checked = False  # without a GPU: the first output is checked as a capture's
        if self.eager_reason is not None:
            runtime.warn_user(f"breakgraph: {self.eager_reason}; GraphRunner runs {function_name(fn)} eagerly")

    @property
    def graphs(self) -> dict[tuple[Hashable, int], BreakableCUDAGraph]:
        """The captured graph of every (key, size); key is None without ``keys``."""
        return {key_size: graphed.graph for key_size, graphed in self._policy.graphed.items()}

    @property
    def pool(self) -> torch.cuda.MemPool | None:
        """The memory pool every size's graph allocates from (None before the first capture)."""
        return self._memory.pool

    @property
    def released(self) -> bool:
        """Whether :meth:`release` gave the graphs' memory up and :meth:`restore` has not brought it back."""
        return self._memory.released is not None

    @property
    def refusals(self) -> dict[tuple[Hashable, int], list[Refusal]]:
        """With ``share_executables``: the segments of each (key, size) that keep their own executable."""
        return self._memory.refusals

    # -- capture ----------------------------------------------------------------------
    def capture(self, keys: Sequence[Hashable] | None = None, sizes: Sequence[int] | None = None) -> "GraphRunner":
        """Capture every (key, size), largest size first, into one shared memory pool.
        With ``lazy=True`` this only prepares the pool: sizes are captured on first use.

        Arguments:
            keys (sequence of keys, optional): capture only these keys' sizes now (the
                others by a later call, or on first use); default: every key.
            sizes (sequence of int, optional): capture only these of the keys' sizes now
                (a size some of the keys lack is skipped for those; one that none of them
                has is refused); default: every size.
        """
        wanted = self.keys if keys is None else known_keys(keys, self.keys)
        work = [(key, size) for key in wanted for size in self.sizes_by_key[key]]
        if sizes is not None:
            chosen = set(known_sizes(sizes, [size for _key, size in work]))
            work = [(key, size) for key, size in work if size in chosen]
        if self._memory.released is not None:
            raise RuntimeError("this GraphRunner is released (runner.release()): call runner.restore() first, which captures again what was captured")
        if self.eager_reason is not None:
            return self
        self.inputs.require_cuda()
        if self.options.lazy:
            self._memory.ensure_pool()
            return self
        self._capture_each(work)
        return self

    def _capture_each(self, work: list[tuple[Hashable, int]]) -> None:
        """Capture the (key, size) pairs of ``work`` not captured yet, largest size first."""
        work = sorted((item for item in work if not self._policy.done(*item)), key=lambda item: -item[1])
        pool = self._memory.ensure_pool()  # also with no work: a runner with no pool captures every size on its first call
        if not work:
            return
        with progress_bar(len(work), self.options.progress) as advance:
            # Tensor-parallel ranks capture every size under one agreement, and only where that
            # fails, each size under its own, where a failure is retried or served eagerly.
            if self.ranks is None or len(work) < 2 or not self._policy.capture_together(work, pool, advance):
                advance.restart()
                for key, size in work:
                    self._policy.capture(key, size, pool)
                    advance()
        self._memory.share_among_sizes()

    # -- dispatch ------------------------------------------------------------------------
    def select(self, n: int, candidates: Sequence[Hashable] = (None,)) -> tuple[Hashable, int] | None:
        """The (key, size) graph a batch of ``n`` rows goes to, or None for eager.

        Arguments:
            n (int): the batch's rows.
            candidates (sequence of keys, optional): the keys that may serve it, most
                preferred first (what ``key_fn`` returns). Default: the one key None.
        """
        for key in candidates:
            size = choose_size(self.sizes_by_key.get(key, ()), n)
            if size is not None:
                return key, size
        return None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run a live batch (shaped like the static inputs but for dimension 0) through the
        graph of the smallest captured size that fits, or eagerly above the largest; with
        ``group``, the size that fits the largest batch of any rank."""
        inputs = self.inputs.live(args, kwargs)
        live = self.inputs.check(inputs)
        n = live[0].shape[0]
        candidates = self._candidates(inputs)
        rows = self._rows_of_every_rank(n, candidates)
        if self._memory.released is not None:
            if self._memory.while_released == "raise":
                raise RuntimeError("this GraphRunner's graphs are released (runner.release()): call runner.restore() first")
            return self._run_eagerly(inputs, candidates[0], n, rows)
        if self.eager_reason is None and self.pool is None:
            self.capture()
        chosen = None if self.eager_reason is not None else self.select(rows, candidates)
        if chosen is None:
            if self.eager_reason is None and not self._logged_eager:
                log.debug("batch of %d rows fits no captured size: running eagerly", rows)
                self._logged_eager = True
            return self._run_eagerly(inputs, candidates[0], n, rows)
        key, size = chosen
        self.inputs.fill(live, size, self.options.pad_value)
        graphed = self._policy.graphed.get((key, size))
        if graphed is not None:
            output = graphed.replay()
        elif not self._policy.done(key, size) and (
            graphed := self._policy.capture_on_first_use(key, size, self.pool, after=self._memory.share_among_sizes)
        ) is not None:
            output = graphed.output  # lazy: captured on first use, and replayed there for this call
        else:  # its capture failed: the same padded buffers, eagerly
            output = self._run_eagerly(self.inputs.views(size), key, size, size)
        return live_rows(output, size, n, self.options.clone)

    def _rows_of_every_rank(self, n: int, candidates: list[Hashable]) -> int:
        """``n``, or with ``group`` (and ``agree_batches``) the largest batch of any rank, once
        the ranks agree on ``candidates``: each walks them to pick the graph."""
        if self.ranks is None or not self.options.agree_batches:
            return n
        preference = [self.keys.index(key) for key in candidates]
        return self.ranks.dispatch(n, preference + [-1] * (len(self.keys) - len(preference)))

    def _run_eagerly(self, inputs: Any, key: Hashable, n: int, rows: int) -> Any:
        """``fn`` on ``inputs`` padded from ``n`` to ``rows`` rows (so that every rank's
        collectives see the same shapes), cut back to ``n``."""
        if rows > n:
            inputs = self.inputs.padded(inputs, rows, self.options.pad_value)
        args, kwargs = self._policy.arguments(inputs, key)
        output = self.fn(*args, **kwargs)
        if self.eager_reason is not None and not self._output_checked:  # the rule a capture holds it to
            check_output(function_name(self.fn), output)
            self._output_checked = True
        return live_rows(output, rows, n, clone=False) if rows > n else output

    def _candidates(self, inputs: Any) -> list[Hashable]:
        if self.key_fn is None:
            return [None]
        key_args, key_kwargs = self._policy.arguments(inputs, None)
        return preferred_keys(self.key_fn(*key_args, **key_kwargs), self.keys)

    # -- memory ----------------------------------------------------------------------------
    def memory(self) -> dict:
        """Device memory the graphs hold now: the shared pool (reserved, allocated or cached)
        and the executables (measured with ``cudaMemGetInfo`` at instantiation). The
        executables' bytes, and so the total, are None where some graph's were not
        measured (``measure_memory=False``, the default)."""
        return self._memory.usage()

    def estimate_memory(self, probes: int = 5) -> MemoryEstimate:
        """Capture a few sizes of every key (the largest, the smallest and ``probes - 2``
        between; they stay captured, and :meth:`capture` captures the rest) and estimate
        what the graphs of all sizes will hold (pool and executables: the probes measure
        their executables whatever ``measure_memory`` says). Call it before :meth:`capture`.
        On the eager path (no GPU, or ``BREAKGRAPH_DISABLE=1``) it captures nothing and
        estimates zero bytes: no graph will hold memory.

        Arguments:
            probes (int, optional): how many sizes per key to capture, at least 2. Default: 5.
        """
        require_count("probes", probes, least=2)  # the largest size and the smallest at least
        if self.eager_reason is not None:
            return MemoryEstimate(0, 0, probed_sizes=(), seconds=0.0)
        self.inputs.require_cuda()
        return self._memory.estimate(self.sizes_by_key, probes)

    def release(self, keep_graphs: bool = False, while_released: str = "eager") -> dict:
        """Give the graphs' device memory back, as an engine going to sleep does. Outputs of
        earlier calls must not be used after a release. Returns the bytes freed
        (``cudaMemGetInfo`` before and after) and the seconds it took. Without a GPU
        nothing is freed (0 bytes), and calls until :meth:`restore` behave as
        ``while_released`` says, as with one.

        Arguments:
            keep_graphs (bool, optional): False (default) frees the pool and every
                executable, and :meth:`restore` captures again; True frees the
                executables only, keeping the captured graphs and the pool, and
                :meth:`restore` instantiates them again.
            while_released (str, optional): until :meth:`restore`, calls run ``fn``
                eagerly ("eager", default) or raise ("raise").
        """
        require_bool("keep_graphs", keep_graphs)
        require_choice("while_released", while_released, ("eager", "raise"))
        return self._memory.release(keep_graphs, while_released)

    def restore(self) -> dict:
        """Bring back what :meth:`release` gave up: instantiate the kept graphs again, or
        capture again the sizes that were captured (on the eager path, none); replays then match
        those before the release. Returns the device memory taken (``cudaMemGetInfo``) and the
        seconds it took."""
        return self._memory.restore(self._capture_each if self.eager_reason is None else lambda work: None)

    # -- report --------------------------------------------------------------------------
    def report(self, print_table: bool = True) -> dict:
        """Sizes captured, segments per size, capture time per size (and whether it needed a
        warm-up run), the first-use latency of sizes captured lazily, pool bytes, and the
        executables' memory where it was measured (``executable_kib`` is "" and
        ``executable_bytes`` None where not).

        Arguments:
            print_table (bool, optional): also print it as a table. Default: True.
        """
        require_bool("print_table", print_table)
        rows, failed = self._policy.report_rows()
        report = {"rows": rows, "failed": failed, "eager_reason": self.eager_reason} | self.memory()
        if print_table:
            diagnostics.print_runner_report(report, shared=self.options.share_executables)
        return report
