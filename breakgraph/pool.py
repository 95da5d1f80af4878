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
