"""A runner's device memory: its shared pool, shared executables, measuring, estimating,
releasing and restoring."""

from __future__ import annotations

import enum
import time
from typing import Callable, Hashable

import torch

import breakgraph_bindings as bindings
from breakgraph.base import runtime
from breakgraph.base.estimate import MemoryEstimate, Probe, extrapolate, probe_sizes
from breakgraph.base.pool import OwnedPool, PoolUsage, new_pool, pool_bytes
from breakgraph.serving.policy import CapturePolicy, KeySize
from breakgraph.graphs.sharing import Refusal, share_executables


class Released(enum.Enum):
    """What a released runner gave back: its executables (graphs and pool kept), or everything."""

    EXECUTABLES = "executables"
    EVERYTHING = "everything"


class RunnerMemory:
    """What a runner's graphs hold on the device, and the means to plan around it.

    All sizes capture into one pool, largest first, so smaller sizes reuse
    the larger ones' activations. ``share`` keeps one executable per segment
    and topology for all sizes of a key (:mod:`breakgraph.graphs.sharing`).
    """

    def __init__(self, policy: CapturePolicy, keys: list[Hashable], share: bool, eager: bool):
        self.policy, self.keys, self.share = policy, keys, share
        self.eager = eager  # the runner's eager path: no graph holds memory, so none is measured
        self._pool: OwnedPool | None = None
        self.refusals: dict[KeySize, list[Refusal]] = {}
        self.released: Released | None = None
        self.while_released = "eager"
        self._captured_before: list[KeySize] = []  # what a release of everything let go, captured again on restore

    @property
    def pool(self) -> torch.cuda.MemPool | None:
        """The pool every graph allocates from (None before the first capture)."""
        return None if self._pool is None else self._pool.pool

    def ensure_pool(self) -> torch.cuda.MemPool:
        if self._pool is None:
            self._pool = OwnedPool(new_pool())
        return self._pool.pool

    def share_among_sizes(self) -> None:
        """With ``share``, let every key's graphs launch one executable per segment and
        topology where CUDA can update them; refused segments are tried again next time."""
        if not self.share:
            return
        for key in self.keys:
            captured = [(size, graphed.graph) for (k, size), graphed in self.policy.graphed.items() if k == key]
            refusals = share_executables([graph for _size, graph in captured])
            self.refusals = {key_size: refused for key_size, refused in self.refusals.items() if key_size[0] != key}
            for refusal in refusals:
                self.refusals.setdefault((key, captured[refusal.graph][0]), []).append(refusal)

    def usage(self) -> dict:
        """The pool's bytes (reserved: allocated or cached) and the executables' (None where
        some graph's were not measured), and their total (None likewise)."""
        pool = pool_bytes(self.pool) if self.pool is not None else 0
        measured = [graphed.graph.executable_bytes for graphed in self.policy.graphed.values()]
        executables = None if None in measured else sum(measured)
        total = None if executables is None else pool + executables
        return {"pool_bytes": pool, "executable_bytes": executables, "total_bytes": total}

    def estimate(self, sizes_by_key: dict[Hashable, list[int]], probes: int) -> MemoryEstimate:
        """Capture a few sizes of every key (they stay captured), measuring their
        executables, and extrapolate to every size."""
        runtime.require_cuda("GraphRunner.estimate_memory")
        if self.released is not None:
            raise RuntimeError("this GraphRunner is released (runner.release()): call runner.restore() first")
        if self.policy.graphed or self.policy.failed:
            raise RuntimeError("estimate_memory() captures its probes into an empty runner: call it before capture()")
        started = time.perf_counter()
        pool = self.ensure_pool()
        work = sorted(((key, size) for key in self.keys for size in probe_sizes(sizes_by_key[key], probes)), key=lambda item: -item[1])
        usage = PoolUsage.of(pool)
        probes_by_key: dict[Hashable, list[Probe]] = {}
        for key, size in work:
            kept_before = usage.allocated_bytes
            graphed = self.policy.capture(key, size, pool, measure=True)
            usage = PoolUsage.of(pool)
            if graphed is not None:
                kept = usage.allocated_bytes - kept_before
                probes_by_key.setdefault(key, []).append(Probe(size, kept, graphed.graph.executable_bytes, usage.reserved_bytes))
        seconds = time.perf_counter() - started
        self.share_among_sizes()  # the probes, as capture() shares what it captures
        return extrapolate(sizes_by_key, probes_by_key, usage.reserved_bytes, seconds, usage.allocated_bytes)

    def release(self, keep_graphs: bool, while_released: str) -> dict:
        """Free the executables (``keep_graphs``) or everything; see ``GraphRunner.release``."""
        if self.released is not None:
            raise RuntimeError("this GraphRunner is released already: call restore() first")
        taken_bytes, seconds = _measured(self._release_executables if keep_graphs else self._release_everything, not self.eager)
        self.released = Released.EXECUTABLES if keep_graphs else Released.EVERYTHING
        self.while_released = while_released
        return {"freed_bytes": -taken_bytes, "seconds": seconds}

    def _release_executables(self) -> None:
        for graphed in self.policy.graphed.values():
            graphed.graph.release_executables()

    def _release_everything(self) -> None:
        self._captured_before = list(self.policy.graphed)
        self.policy.forget()
        self.refusals.clear()
        self._pool = None  # a MemPool gives its cached blocks back as it dies

    def restore(self, capture: Callable[[list[KeySize]], object]) -> dict:
        """Instantiate the kept graphs again, or capture again (``capture(pairs)``) the (key,
        size) pairs that were captured before the release."""
        if self.released is None:
            raise RuntimeError("this GraphRunner is not released: nothing to restore")
        if self.released is Released.EXECUTABLES:
            taken_bytes, seconds = _measured(self._restore_executables, not self.eager)
        else:
            self.released = None  # capture captures only while nothing is released
            taken_bytes, seconds = _measured(lambda: capture(self._captured_before), not self.eager)
        return {"taken_bytes": taken_bytes, "seconds": seconds}

    def _restore_executables(self) -> None:
        for graphed in self.policy.graphed.values():
            graphed.graph.restore_executables()
        self.released = None
        self.share_among_sizes()


def _measured(action: Callable[[], object], measure: bool) -> tuple[int, float]:
    """Run ``action`` and return the device memory it took and the seconds it took: with
    ``measure``, with the device idle before and after (``cudaMemGetInfo``, negative when
    it freed some); else 0 bytes (the eager path, where no graph holds memory)."""
    if not measure:
        started = time.perf_counter()
        action()
        return 0, time.perf_counter() - started
    torch.cuda.synchronize()
    free_before, started = bindings.free_device_memory(), time.perf_counter()
    action()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    return free_before - bindings.free_device_memory(), seconds
