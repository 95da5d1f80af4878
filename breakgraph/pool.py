"""Glue to torch's caching allocator: one private memory pool per graph, shareable."""

from __future__ import annotations

import torch


def new_pool() -> "torch.cuda.MemPool":
    """A fresh private pool. While it is alive its cached blocks are never handed to
    allocations outside it, so the addresses a replay writes stay reserved."""
    return torch.cuda.MemPool()


def pool_bytes(pool) -> int:
    """Bytes of device memory the pool holds (allocated or cached)."""
    return sum(segment["total_size"] for segment in pool.snapshot())


def allocated_blocks(pool) -> dict[int, int]:
    """Address and size of every block of ``pool`` that a tensor holds now."""
    return {
        block["address"]: block["size"]
        for segment in pool.snapshot()
        for block in segment["blocks"]
        if block["state"] == "active_allocated"
    }


def holds(pool, address: int) -> bool:
    """Whether ``address`` lies in memory ``pool`` reserves (allocated or cached)."""
    return any(segment["address"] <= address < segment["address"] + segment["total_size"] for segment in pool.snapshot())
