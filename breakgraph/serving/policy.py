"""How a runner captures one (key, size): warm-up, retry, lazy capture and the eager fallback."""

from __future__ import annotations

import logging
import time
from typing import Callable, Hashable, Sequence

import torch

from breakgraph import diagnostics
from breakgraph.base import runtime
from breakgraph.base.sizes import by_key_and_size
from breakgraph.serving.batches import StaticInputs
from breakgraph.recording.dispatch import UncapturableOpError, is_capture_invalidated, is_capture_violation
from breakgraph.graphs.graphed import GraphedCallable
from breakgraph.base.options import RunnerOptions
from breakgraph.serving.rank_group import GIVE_UP, KEEP, RETRY, RankGroup
from breakgraph.base.ranks import PeerCaptureError

log = logging.getLogger("breakgraph.runner")

KeySize = tuple[Hashable, int]


class CapturePolicy:
    """The captured graphs of a runner, and how each came to be.

    ``warmup="auto"`` warms a key up once, at its first size, and captures
    every other size directly; a size whose capture fails the way lazy
    initialisation inside a capture fails is warmed up once and captured
    again. An int warms up that many times before every size. With
    ``on_capture_error="eager"`` a failed size is remembered and served
    eagerly. With ``ranks`` every rank does each of these together: a capture
    is kept on every rank or raised on every rank, and a retry is agreed.
    """

    def __init__(
        self,
        fn: Callable,
        inputs: StaticInputs,
        modes: dict[Hashable, str],
        options: RunnerOptions,
        ranks: RankGroup | None = None,
    ):
        self.fn, self.inputs, self.modes, self.options, self.ranks = fn, inputs, modes, options, ranks
        self._tags = {key: index << 32 for index, key in enumerate(modes)}  # what ranks agree they capture
        self.debug = runtime.debug_requested(options.debug)
        self.graphed: dict[KeySize, GraphedCallable] = {}
        self.failed: dict[KeySize, str] = {}
        self.capture_seconds: dict[KeySize, float] = {}
        self.first_use_seconds: dict[KeySize, float] = {}
        self.warmed_up: set[KeySize] = set()
        self.draws: dict[Hashable, bool | None] = {}  # per key: whether fn drew random numbers

    def arguments(self, inputs: object, key: Hashable) -> tuple[tuple, dict]:
        """How ``fn`` is called on ``inputs``: shaped like the static inputs, and ``key=`` when
        the runner has keys (``key`` is None otherwise)."""
        return self.inputs.arguments(inputs, {} if key is None else {"key": key})

    def done(self, key: Hashable, size: int) -> bool:
        """Whether (key, size) was captured, or its capture failed and it is served eagerly."""
        return (key, size) in self.graphed or (key, size) in self.failed

    def report_rows(self) -> tuple[list[dict], list[dict]]:
        """The runner report's rows: one per captured (key, size), by key and size, and one
        per size served eagerly since its capture failed."""
        rows = [
            diagnostics.runner_row(key, self.modes[key], size, graphed.graph, self.capture_seconds[(key, size)],
                                   (key, size) in self.warmed_up, self.first_use_seconds.get((key, size)))
            for (key, size), graphed in sorted(self.graphed.items(), key=by_key_and_size)
        ]
        failed = [
            {"key": "" if key is None else key, "mode": self.modes[key], "size": size, "reason": reason}
            for (key, size), reason in sorted(self.failed.items(), key=by_key_and_size)
        ]
        return rows, failed

    def capture(self, key: Hashable, size: int, pool: torch.cuda.MemPool, measure: bool | None = None) -> GraphedCallable | None:
        """Capture (key, size) into ``pool``, measuring its executables' memory if ``measure``
        (default: the runner's ``measure_memory``). With ``on_capture_error="eager"`` a
        failure is logged and remembered, and None returned: the size is served eagerly."""
        started = time.perf_counter()
        measure = self.options.measure_memory if measure is None else measure
        try:
            graphed = self._warm_up_and_capture(key, size, pool, measure)
        except Exception as error:
            if self.options.on_capture_error == "raise":
                raise
            self.failed[(key, size)] = f"{type(error).__name__}: {error}"
            log.warning("capture of size %d (key %r) failed; serving it eagerly: %s", size, key, self.failed[(key, size)])
            return None
        self.graphed[(key, size)] = graphed
        self.capture_seconds[(key, size)] = time.perf_counter() - started
        return graphed

    def capture_together(self, work: Sequence[KeySize], pool: torch.cuda.MemPool, advance: Callable[[], object]) -> bool:
        """With ``ranks``: capture every (key, size) of ``work`` under one agreement, so that the
        ranks meet once for them all rather than once a size, and wait for the slowest rank
        once. True when every rank kept them all. Otherwise every rank discards them and
        returns False, and each size is captured again under an agreement of its own, where
        a failure is warmed up and retried, served eagerly or raised, as ``options`` say.
        ``advance()`` after each size (a progress bar's)."""
        measure = self.options.measure_memory
        warmups = self._warmups_of(work)
        seconds: list[float] = []

        def attempt(index: int, barrier) -> GraphedCallable:
            started = time.perf_counter()
            key, size = work[index]
            if index and warmups[index]:
                # A warm-up runs the step's collectives for real: the ranks meet first, so that
                # none runs them while a peer whose last capture failed waits to say so.
                barrier()
            graphed = self._graphed_with(barrier, key, size, warmups[index], pool, measure)
            seconds.append(time.perf_counter() - started)
            advance()
            return graphed

        try:
            made = self.ranks.capture_each(
                [self._tags[key] + size for key, size in work], attempt,
                discard=lambda made: _reset_all(graphed.graph for graphed in made),
            )
        except Exception as error:
            if isinstance(error, PeerCaptureError) and error.lost:
                raise
            log.info("capturing %d sizes under one agreement failed (%s); capturing them one at a time", len(work), error)
            return False
        for key_size, graphed, took, warmup in zip(work, made, seconds, warmups):
            self.graphed[key_size] = graphed
            self.capture_seconds[key_size] = took
            if warmup:
                self.warmed_up.add(key_size)
        return True

    def _warmups_of(self, work: Sequence[KeySize]) -> list[int]:
        """The warm-up runs before each capture of ``work`` made in one go: ``warmup`` times
        each, or with "auto" once at each key's first size (none is retried in between)."""
        if self.options.warmup != "auto":
            return [self.options.warmup] * len(work)
        seen = {key for key, _size in self.graphed}
        warmups = []
        for key, _size in work:
            warmups.append(0 if key in seen else 1)
            seen.add(key)
        return warmups

    def capture_on_first_use(
        self, key: Hashable, size: int, pool: torch.cuda.MemPool, after: Callable[[], None]
    ) -> GraphedCallable | None:
        """Lazy capture: capture (key, size), call ``after()`` (sharing), and replay once for
        the call that needed it (its ``output``), remembering how long the whole first use
        took. None where the capture failed (served eagerly)."""
        started = time.perf_counter()
        graphed = self.capture(key, size, pool)
        if graphed is None:
            return None
        after()
        graphed.replay()
        torch.cuda.current_stream(graphed.graph.device).synchronize()
        self.first_use_seconds[(key, size)] = time.perf_counter() - started
        return graphed

    def forget(self) -> None:
        """Drop every graph and what was learnt capturing it (the runner releases its
        memory); failures are kept."""
        self.graphed.clear()
        self.capture_seconds.clear()
        self.first_use_seconds.clear()
        self.warmed_up.clear()

    def _warm_up_and_capture(self, key: Hashable, size: int, pool: torch.cuda.MemPool, measure: bool) -> GraphedCallable:
        warmup = self.options.warmup
        if warmup != "auto":
            graphed = self._graphed_at(key, size, warmup, pool, measure)
            if warmup:
                self.warmed_up.add((key, size))
            return graphed
        first_of_key = not any(done == key for done, _size in self.graphed)
        try:
            graphed = self._graphed_at(key, size, 1 if first_of_key else 0, pool, measure)
        except Exception as error:
            if not self._retry(error, may_retry=not first_of_key):
                raise
            log.info("capture of size %d failed without warm-up (%s): warming up and capturing again", size, error)
            graphed = self._graphed_at(key, size, 1, pool, measure)
            first_of_key = True
        if first_of_key:
            self.warmed_up.add((key, size))
        return graphed

    def _retry(self, error: Exception, may_retry: bool) -> bool:
        """Whether a failed capture is warmed up and made again: a failure the way lazy
        initialisation inside a capture fails, at a size that was not warmed up; with
        ``ranks``, on every rank when some rank's failure is that and none's is worse."""
        retryable = may_retry and (
            isinstance(error, UncapturableOpError) or is_capture_violation(error) or is_capture_invalidated(error)
        )
        if self.ranks is None:
            return retryable
        if isinstance(error, PeerCaptureError):  # a peer's failure: that peer's report decides
            return not error.lost and self.ranks.retry_together(KEEP)
        return self.ranks.retry_together(RETRY if retryable else GIVE_UP)

    def _graphed_at(self, key: Hashable, size: int, warmup: int, pool: torch.cuda.MemPool, measure: bool) -> GraphedCallable:
        if self.ranks is None:
            return self._graphed_with(None, key, size, warmup, pool, measure)
        return self.ranks.capture(
            self._tags[key] + size,
            lambda barrier: self._graphed_with(barrier, key, size, warmup, pool, measure),
            discard=lambda graphed: graphed.graph.reset(),
        )

    def _graphed_with(
        self, barrier: Callable[[], None] | None, key: Hashable, size: int, warmup: int, pool: torch.cuda.MemPool, measure: bool
    ) -> GraphedCallable:
        args, kwargs = self.arguments(self.inputs.views(size), key)
        breaks = "inline" if self.modes[key] == "full" else "eager"
        options = self.options.capture(breaks, measure, barrier)
        graphed = GraphedCallable(
            self.fn, args, kwargs, options, debug=self.debug, pool=pool, warmup=warmup, warn=False,
            draws_random_numbers=self.draws.get(key),
        )
        self.draws[key] = graphed.draws_random_numbers
        graphed.graph.set_replay_hooks(self.options.before_replay, self.options.after_replay)
        return graphed


def _reset_all(graphs) -> None:
    """Reset every graph, even after one raised; then raise the first error."""
    errors = []
    for graph in graphs:
        try:
            graph.reset()
        except Exception as error:
            errors.append(error)
    if errors:
        raise errors[0]
