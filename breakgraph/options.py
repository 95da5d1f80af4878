"""What a capture is asked to do, checked once where the user says it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from breakgraph_bindings import CaptureMode

RANDOM_OPS = ("graph", "break", "error")
BREAKS = ("eager", "inline")


@dataclass(frozen=True)
class CaptureOptions:
    """How a capture treats what it meets, checked once where the user gives it.

    ``capture_error_mode``: CUDA's capture mode. ``random_ops``: "graph"
    (captured into the segments), "break" (each random op an eager break,
    through the op watch) or "error" (refused). ``generators``: CUDA
    generators armed beside the device's default one. ``breaks``: "eager"
    (breakable: every break splits the graph) or "inline" (one full graph:
    every break records its capturable variant). ``barrier_fn``: called after
    a segment ends and before each break runs, and once at the end.
    ``measure_memory``: read ``cudaMemGetInfo`` around every segment's
    instantiation (two calls of about 5 µs each per segment, so only when asked).
    """

    capture_error_mode: CaptureMode = CaptureMode.GLOBAL
    random_ops: str = "graph"
    generators: tuple = ()
    breaks: str = "eager"
    barrier_fn: Callable[[], Any] | None = None
    measure_memory: bool = False

    @classmethod
    def parse(
        cls, capture_error_mode="global", random_ops="graph", generators=(), breaks="eager", barrier_fn=None, measure_memory=False
    ):
        if random_ops not in RANDOM_OPS:
            raise ValueError(f"random_ops must be 'graph', 'break' or 'error', got {random_ops!r}")
        if breaks not in BREAKS:
            raise ValueError(f"breaks must be 'eager' (breakable graphs) or 'inline' (full graphs), got {breaks!r}")
        if barrier_fn is not None and not callable(barrier_fn):
            raise TypeError(f"barrier_fn must be callable, got {type(barrier_fn).__name__}")
        if not isinstance(measure_memory, bool):
            raise TypeError(f"measure_memory must be True or False, got {measure_memory!r}")
        generators = tuple(generators or ())
        for gen in generators:
            if not isinstance(gen, torch.Generator) or gen.device.type != "cuda":
                raise TypeError(f"generators must be CUDA torch.Generator objects, got {gen!r}")
        return cls(CaptureMode.parse(capture_error_mode), random_ops, generators, breaks, barrier_fn, measure_memory)

    def arguments(self) -> dict:
        """These options as keyword arguments of a capture."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}


MODES = ("breakable", "full", "none")
"""A runner key's graph mode: breaks eager between segments, breaks inline in one full graph, or no graphs."""


def parse_modes(modes, keys: list) -> dict:
    """Each key's graph mode, from one mode for all or a dict with every key."""
    if isinstance(modes, str):
        modes = dict.fromkeys(keys, modes)
    if not isinstance(modes, dict):
        raise TypeError(f"modes must be one of {MODES} for every key, or a dict of key -> mode; got {modes!r}")
    if set(modes) != set(keys):
        declared = (
            "this runner has the one key None, since it was made without keys=: give one mode for all "
            "(modes='full'), or declare the keys with keys=[...] and key_fn=..."
            if keys == [None]
            else f"this runner's keys (keys=) are {keys}"
        )
        raise ValueError(f"modes gives keys {list(modes)}, but {declared}; a dict must give each key exactly one mode")
    for key, mode in modes.items():
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} of key {key!r} is not one of {MODES}")
    return dict(modes)


def parse_warmup(warmup, allow_auto: bool) -> int | str:
    """How many eager runs come before a capture: a whole number >= 0, or (for a runner)
    "auto"."""
    if allow_auto and warmup == "auto":
        return warmup
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        choices = "'auto' or a number of eager runs >= 0" if allow_auto else "a number of eager runs >= 0"
        raise ValueError(f"warmup must be {choices}, got {warmup!r}")
    return warmup
