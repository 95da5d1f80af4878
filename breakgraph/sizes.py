"""Batch sizes: which to capture, and which captured size serves a live batch."""

from __future__ import annotations

import bisect
from typing import Sequence


def default_capture_sizes(max_size: int) -> list[int]:
    """The engines' habit: 1, 2, 4, 8, then every multiple of 8 up to ``max_size`` (itself included).

    Arguments:
        max_size (int): the largest batch to capture, at least 1.
    """
    if isinstance(max_size, bool) or not isinstance(max_size, int):
        raise TypeError(f"max_size must be a whole number of rows (the largest batch to capture), got {max_size!r}")
    if max_size < 1:
        raise ValueError(f"max_size must be at least 1 (the largest batch to capture), got {max_size}")
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
