"""What capturing every batch size will cost, extrapolated from capturing a few.

Engines size their KV cache from the memory graphs leave free, before they
capture. Capturing the largest size first fills the shared pool with the
activations every smaller size reuses; each further size then adds only what
it keeps (its outputs, the results of its breaks), which grows linearly with
the batch size, and the executables the driver instantiates for its segments.
So :func:`extrapolate` takes a few probed sizes (the largest among them) and
fits both per-size costs with a least-squares line in the batch size, rather
than scaling the first graph's whole cost by the number of sizes, which
overestimates several-fold (docs/memory.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

SEGMENT_BYTES = 2 * 2**20
"""The granule torch's allocator reserves small blocks in: a pool grows by whole segments."""


@dataclass(frozen=True)
class Probe:
    """One probed size: the bytes it left allocated in the pool, the device memory its
    executables took, and the pool's reserved bytes after it."""

    size: int
    kept_bytes: int
    executable_bytes: int
    pool_bytes: int = 0


@dataclass(frozen=True)
class MemoryEstimate:
    """The estimate for every size: pool bytes (reserved), executable bytes, and how it was
    made (the probes, and the pool's allocated bytes after them)."""

    pool_bytes: int
    executable_bytes: int
    probed_sizes: tuple[int, ...]
    seconds: float
    probes: tuple[Probe, ...] = ()
    pool_allocated_after_probes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.pool_bytes + self.executable_bytes


def probe_sizes(sizes: Sequence[int], count: int = 5) -> list[int]:
    """The sizes to capture for an estimate: the largest (it sets the pool's peak), the
    smallest, and sizes spread evenly between, largest first."""
    ordered = sorted(set(sizes))
    if len(ordered) <= count:
        return ordered[::-1]
    picks = {ordered[round(i * (len(ordered) - 1) / (count - 1))] for i in range(count)}
    return sorted(picks, reverse=True)


def line(points: Sequence[tuple[float, float]]):
    """The least-squares line through ``points`` as a function; a constant for one point
    (or for points that share one x), zero for none."""
    if not points:
        return lambda x: 0.0
    xs, ys = zip(*points)
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    if spread == 0:
        return lambda x: mean_y
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread
    return lambda x: mean_y + slope * (x - mean_x)


def extrapolate(
    sizes_by_key: dict,
    probes_by_key: dict,
    pool_bytes_after_probes: int,
    seconds: float = 0.0,
    pool_allocated_after_probes: int = 0,
) -> MemoryEstimate:
    """Estimate pool and executable bytes for every key's sizes from its probes (captured
    largest first) and the shared pool's reserved bytes after all of them.

    Each size not probed adds the bytes it keeps (a line through its key's probes after
    the first, whose kept bytes include what every size reuses), rounded up to the
    pool's segments, and its executables (a line through all its key's probes)."""
    more_kept = 0.0
    executable = 0.0
    probed_sizes = set()
    for key, sizes in sizes_by_key.items():
        probes = probes_by_key.get(key, [])
        probed = {probe.size for probe in probes}
        probed_sizes |= probed
        kept = line([(p.size, p.kept_bytes) for p in probes[1:]])
        executables = line([(p.size, p.executable_bytes) for p in probes])
        rest = [size for size in sizes if size not in probed]
        more_kept += sum(max(0.0, kept(size)) for size in rest)
        executable += sum(p.executable_bytes for p in probes) + sum(max(0.0, executables(size)) for size in rest)
    pool = pool_bytes_after_probes + math.ceil(more_kept / SEGMENT_BYTES) * SEGMENT_BYTES
    probes = tuple(probe for key in probes_by_key for probe in probes_by_key[key])
    return MemoryEstimate(
        int(pool), int(round(executable)), tuple(sorted(probed_sizes)), seconds, probes, pool_allocated_after_probes
    )
