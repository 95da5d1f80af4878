"""Glue to torch's caching allocator: one private memory pool per graph, shareable.

What a pool holds is read from the allocator's global snapshot, filtered by
pool id, as torch's own cudagraph trees read it. ``MemPool.snapshot()`` and
``memory_snapshot(mempool_id)`` are never called: they release a reference
to the pool id they never took, which corrupts Python's heap once pool ids
pass 256 (PyTorch PR #196366), so a process that had made a few hundred
graphs crashed in debug mode or in ``GraphRunner.report()``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch


def new_pool() -> "torch.cuda.MemPool":
    """A fresh private pool. While it is alive its cached blocks are never handed to
    allocations outside it, so the addresses a replay writes stay reserved."""
    return torch.cuda.MemPool()


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
    def of(cls, pool) -> "PoolUsage":
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


def require_pool(pool) -> None:
    """Refuse anything but a ``torch.cuda.MemPool``, saying where one comes from."""
    if not isinstance(pool, torch.cuda.MemPool):
        hint = "; a GraphRunner has a pool once it has captured (runner.capture())" if pool is None else ""
        raise TypeError(
            f"expected a torch.cuda.MemPool (a BreakableCUDAGraph's or GraphRunner's .pool), got {type(pool).__name__}{hint}"
        )
