"""Debug-mode replay: each step checked, synchronized and named when it fails.

A debug-mode graph replays the same steps as a normal one, each wrapped:
before a break runs, its argument tensors must still sit at their
capture-time addresses; after every step the stream is synchronized, so a
CUDA error is reported by the step that raised it; with ``check_finite``,
break outputs are checked for NaN and Inf.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

import breakgraph_bindings as bindings
from breakgraph.base import trees
from breakgraph.recording.segments import Segment


class SegmentError(RuntimeError):
    """A segment failed during a debug-mode replay; the message names which one."""


Step = Callable[[], None]
"""One step of a replay: a segment's, or a check."""


def checked(
    segments: Sequence[Segment], steps: Sequence[Step], stream: bindings.StreamHandle, check_finite: Callable[[], bool]
) -> list[Step]:
    """``steps`` (each segment's replay on ``stream``, :meth:`ReplayPlan.step_functions
    <breakgraph.graphs.plan.ReplayPlan.step_functions>`), each wrapped with debug mode's checks,
    behind a first step that checks every break's arguments before anything is launched;
    ``check_finite()`` says, at each replay, whether break outputs are checked for NaN and Inf too."""

    def check_every_argument() -> None:
        for segment in segments:
            check_addresses(segment)

    return [check_every_argument] + [_checked(segment, step, stream, check_finite) for segment, step in zip(segments, steps)]


def _checked(segment: Segment, step: Step, stream: bindings.StreamHandle, check_finite: Callable[[], bool]) -> Step:
    def run() -> None:
        try:
            step()
            bindings.synchronize(stream)
        except bindings.CudaError as error:  # a failed launch names its segment already: once is enough
            raise SegmentError(f"{segment.describe()} failed: {str(error).replace(f' ({segment.describe()})', '')}") from error
        except RuntimeError as error:
            if "CUDA error" not in str(error):
                raise
            raise SegmentError(f"{segment.describe()} failed: {error}") from error
        if check_finite():
            _check_finite(segment)

    return run


def check_addresses(segment: Segment) -> None:
    """Raise if a tensor the segment was captured with has moved (been rebound) or been freed:
    the graph still reads the capture-time address."""
    for path, tensor_ref, storage_ref, address, in_pool in segment.argument_addresses:
        tensor = tensor_ref()
        if tensor is not None and tensor.data_ptr() != address:
            raise SegmentError(
                f"{segment.name}() argument {path}: address {address:#x} at capture, "
                f"{tensor.data_ptr():#x} at replay. The graph still reads the old address; "
                "copy new values into the captured tensor (x.copy_(new)) instead of rebinding it"
            )
        if storage_ref.expired() and not in_pool:  # the graph's pool keeps its own blocks reserved
            raise SegmentError(
                f"{segment.name}() argument {path}: its memory ({address:#x}) was freed since capture, and the "
                "graph still reads it. Keep the tensors a graph was captured with alive as long as the graph"
            )


def _check_finite(segment: Segment) -> None:
    if segment.result is None:
        return
    for path, tensor in trees.take_apart(segment.result, objects=True).tensors_with_paths("out"):
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise SegmentError(f"{segment.describe()}: {segment.name}() -> {path} has NaN or Inf values")
