"""Glue to torch's caching allocator: private memory pools, how long they live, and
what they hold.

Every graph allocates from a private ``torch.cuda.MemPool`` (a runner's graphs
share one). Two rules keep pools safe and memory honest:

- **No pool dies while a capture runs.** torch destroys a pool by emptying its
  cache, and a ``cudaFree`` during a capture invalidates it (the process aborts:
  the error is raised in a destructor). Captures hold :func:`captures_running`;
  a pool dropped meanwhile is parked and let go when the last capture ends.
- **A dropped pool gives its memory back.** torch frees a dead pool's cached
  memory at once, except the blocks a user still holds (a graph's outputs);
  those go back to the dead pool's cache when the user drops them, where only
  an emptying of the allocator's cache reaches them. ``torch.cuda.graph``
  empties the whole cache before every capture; breakgraph empties only dead
  pools' caches (:func:`return_dropped_memory`), at every pool drop and capture
  start.

What a pool holds is read from the allocator's global snapshot, filtered by
pool id, as torch's own cudagraph trees read it. ``MemPool.snapshot()`` and
``memory_snapshot(mempool_id)`` are never called: they release a reference
to the pool id they never took, which corrupts Python's heap once pool ids
pass 256 (PyTorch PR #196366), so a process that had made a few hundred
graphs crashed in debug mode or in ``GraphRunner.report()``.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import sys
import threading
from dataclasses import dataclass

import torch


def new_pool() -> "torch.cuda.MemPool":
    """A fresh private pool. While it is alive its cached blocks are never handed to
    allocations outside it, so the addresses a replay writes stay reserved."""
    return torch.cuda.MemPool()


_lock = threading.RLock()  # taken to start or end any capture, and to drop a pool
_captures = 0  # captures running, on all threads
_collector_was_enabled = False
_parked: list = []  # pools dropped while captures ran
_devices: set[int] = set()  # devices breakgraph's pools live on
_routed_to: dict[int, "torch.cuda.MemPool"] = {}  # per device: a pool only ever routed to, never allocated from
_dropped = False  # whether a pool has died, so that memory may wait in dead pools' caches


@contextlib.contextmanager
def captures_running():
    """Hold while a capture runs: pools dropped meanwhile are let go when the last
    capture ends, and Python's cycle collector (which could drop one) stays paused.

    Reference-counted across threads. The first hold returns what dead pools
    cache to the device, and so does the last release where pools were let go
    meanwhile, under the lock, so no capture can start meanwhile.
    """
    global _captures, _collector_was_enabled
    with _lock:
        if _captures == 0:
            return_dropped_memory()
            _collector_was_enabled = gc.isenabled()
            gc.disable()
        _captures += 1
    try:
        yield
    finally:
        with _lock:
            _captures -= 1
            if _captures == 0:
                if _parked:
                    _parked.clear()  # the last references: destroyed here, while no capture can start
                    return_dropped_memory()
                if _collector_was_enabled:
                    gc.enable()


def release_after_captures(owner, attribute: str) -> None:
    """Drop ``owner``'s reference to a memory pool (its attribute ``attribute``) where no
    capture can be running: now, under the lock every capture takes to start, or, while
    captures run on any thread, when the last one ends."""
    global _dropped
    with _lock:
        owned = owner.__dict__.pop(attribute, None)
        if owned is None:
            return
        _dropped = True
        if _captures:
            _parked.append(owned)
            return
        del owned  # when this was the last reference, the pool is destroyed here, under the lock
        return_dropped_memory()


def return_dropped_memory() -> None:
    """Give the device back what dead pools cache: the blocks their graphs' users held
    when the pools died, and have dropped since.

    It empties the allocator's cache while this thread routes its allocations to a
    pool of its own on every device breakgraph's pools live on: torch then frees
    only dead pools' unused segments and leaves the rest of its cache alone. No
    pool may die meanwhile (torch aborts the process when a pool dies while any
    allocation is routed), so it holds the lock every pool drop takes and keeps
    the cycle collector off. It runs where no capture of breakgraph's does: a
    ``cudaFree`` would invalidate it.
    """
    if not _dropped or not torch.cuda.is_initialized():
        return
    with _lock:
        collector = gc.isenabled()
        gc.disable()
        try:
            with contextlib.ExitStack() as routing:
                for device in sorted(_devices):
                    routing.enter_context(torch.cuda.use_mem_pool(_pool_routed_to(device), device))
                torch.cuda.empty_cache()
        finally:
            if collector:
                gc.enable()


def _pool_routed_to(device: int) -> "torch.cuda.MemPool":
    pool = _routed_to.get(device)
    if pool is None:
        with torch.cuda.device(device):
            pool = _routed_to[device] = torch.cuda.MemPool()
    return pool


class OwnedPool:
    """One owner's hold on a memory pool (a graph's, a runner's): when the owner drops it,
    the pool is let go where no capture can be running (:func:`release_after_captures`)."""

    def __init__(self, pool: torch.cuda.MemPool) -> None:
        self.pool = pool
        _devices.add(torch.cuda.current_device())

    def __del__(self) -> None:
        if not sys.is_finalizing():  # at interpreter exit no capture runs, and nothing is given back
            release_after_captures(self, "pool")


_SNAPSHOT_TAKES_TRACES_FLAG = "include_traces" in inspect.signature(torch.cuda.memory_snapshot).parameters


def _allocator_segments() -> list[dict]:
    """Every segment the caching allocator holds, on every device, from one global snapshot
    (without allocation traces where this torch can leave them out: they cost the most)."""
    if _SNAPSHOT_TAKES_TRACES_FLAG:
        return torch.cuda.memory_snapshot(include_traces=False)
    return torch.cuda.memory_snapshot()


@dataclass(frozen=True)
class PoolUsage:
    """One look at the memory a pool reserves: its segments, from one allocator snapshot.

    Take one per check and ask it everything (snapshots are slow: milliseconds,
    more with memory history recording on), rather than one per question.
    """

    segments: tuple[dict, ...]

    @classmethod
    def of(cls, pool: torch.cuda.MemPool) -> PoolUsage:
        require_pool(pool)
        pool_id = tuple(pool.id)
        return cls(tuple(segment for segment in _allocator_segments() if tuple(segment["segment_pool_id"]) == pool_id))

    @property
    def reserved_bytes(self) -> int:
        """Bytes of device memory the pool holds, allocated or cached."""
        return sum(segment["total_size"] for segment in self.segments)

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the pool that tensors hold now."""
        return sum(self.allocated_blocks().values())

    def allocated_blocks(self) -> dict[int, int]:
        """Address and size of every block that a tensor holds now."""
        return {
            block["address"]: block["size"]
            for segment in self.segments
            for block in segment["blocks"]
            if block["state"] == "active_allocated"
        }

    def holds(self, address: int) -> bool:
        """Whether ``address`` lies in memory the pool reserves (allocated or cached)."""
        return any(segment["address"] <= address < segment["address"] + segment["total_size"] for segment in self.segments)


def pool_bytes(pool: "torch.cuda.MemPool") -> int:
    """Bytes of device memory ``pool`` holds, allocated or cached.

    Arguments:
        pool (torch.cuda.MemPool): a graph's or a GraphRunner's ``.pool``, or any pool.
    """
    return PoolUsage.of(pool).reserved_bytes


def require_pool(pool: object) -> None:
    """Refuse anything but a ``torch.cuda.MemPool``, saying where one comes from."""
    if not isinstance(pool, torch.cuda.MemPool):
        hint = ""
        if pool is None:
            hint = "; a GraphRunner has a pool once it has captured (runner.capture())"
        elif isinstance(pool, tuple):
            hint = (
                "; torch.cuda.graph_pool_handle() and graph.pool() give a bare pool id, which breakgraph cannot "
                "route allocations to: make a pool = torch.cuda.MemPool() and pass it here (torch's own graphs "
                "share it through torch.cuda.graph(g, pool=pool.id))"
            )
        raise TypeError(
            f"expected a torch.cuda.MemPool (a BreakableCUDAGraph's or GraphRunner's .pool), got {type(pool).__name__}{hint}"
        )
