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
    """

    capture_error_mode: CaptureMode = CaptureMode.GLOBAL
    random_ops: str = "graph"
    generators: tuple = ()
    breaks: str = "eager"
    barrier_fn: Callable[[], Any] | None = None

    @classmethod
    def parse(cls, capture_error_mode="global", random_ops="graph", generators=(), breaks="eager", barrier_fn=None):
        if random_ops not in RANDOM_OPS:
            raise ValueError(f"random_ops must be 'graph', 'break' or 'error', got {random_ops!r}")
        if breaks not in BREAKS:
            raise ValueError(f"breaks must be 'eager' (breakable graphs) or 'inline' (full graphs), got {breaks!r}")
        if barrier_fn is not None and not callable(barrier_fn):
            raise TypeError(f"barrier_fn must be callable, got {type(barrier_fn).__name__}")
        generators = tuple(generators or ())
        for gen in generators:
            if not isinstance(gen, torch.Generator) or gen.device.type != "cuda":
                raise TypeError(f"generators must be CUDA torch.Generator objects, got {gen!r}")
        return cls(CaptureMode.parse(capture_error_mode), random_ops, generators, breaks, barrier_fn)

    def arguments(self) -> dict:
        """These options as keyword arguments of a capture."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}


MODES = ("breakable", "full", "none")
"""A runner key's graph mode: breaks eager between segments, breaks inline in one full graph, or no graphs."""


def parse_modes(modes, keys: list) -> dict:
    """Each key's graph mode, from one mode for all or a dict with every key."""
    if isinstance(modes, str):
        modes = dict.fromkeys(keys, modes)
    if not isinstance(modes, dict) or set(modes) != set(keys):
        raise ValueError(f"modes must be one of {MODES} or a dict giving each of the keys {keys} one, got {modes!r}")
    for key, mode in modes.items():
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} of key {key!r} is not one of {MODES}")
    return dict(modes)
