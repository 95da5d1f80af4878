"""What a capture does with single torch ops: random ops become breaks, syncs become errors.

torch's CUDA generator only advances its offset under torch's own graph
capture, so a random op inside a raw cuda-python capture would either fail
or, if forced through, replay the same numbers forever. Instead, while a
segment is being captured, a ``TorchDispatchMode`` turns every op tagged
``nondeterministic_seeded`` (dropout, ``randn``, ``uniform_``, …) into an
eager break: it runs eagerly on every replay and draws fresh numbers, and its
outputs are written back where the graph reads them.

The same mode rejects ops that synchronize with the host (``.item()``,
``nonzero``, …) before they reach CUDA, with an error that says how to fix it.
The mode is only active during capture; replay never sees it.
"""

from __future__ import annotations

import re

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from breakgraph.context import ActiveCapture

_aten = torch.ops.aten

# Ops whose CUDA implementation synchronizes with the host: the data decides
# the output size, or the result is read back to Python.
_HOST_SYNC_OPS = {
    _aten._local_scalar_dense.default,
    _aten.nonzero.default,
    _aten.masked_select.default,
    _aten.is_nonzero.default,
    _aten.equal.default,
}

_CAPTURE_VIOLATION = re.compile(
    r"operation not permitted when stream is capturing"
    r"|cudaErrorStreamCapture"
    r"|previous error during capture"
    r"|depend on a capturing blocking stream"
    r"|CUDA generator not in capture mode"
    r"|cudaErrorStreamCaptureInvalidated"
)

REMEDY = (
    "Move it into a function decorated with @breakgraph.eager_on_graph: that function "
    "runs eagerly between graph segments, at capture and at every replay."
)


class UncapturableOpError(RuntimeError):
    """An op inside a graph segment cannot be captured into a CUDA graph."""


def is_capture_violation(error: BaseException) -> bool:
    """Whether ``error`` is CUDA refusing an operation because a stream is capturing."""
    return isinstance(error, RuntimeError) and bool(_CAPTURE_VIOLATION.search(str(error)))


def is_random_op_refusal(error: BaseException) -> bool:
    """Whether ``error`` is torch's CUDA generator refusing a random op in a raw capture."""
    return isinstance(error, RuntimeError) and "CUDA generator not in capture mode" in str(error)


def random_op_uncapturable(cause: BaseException) -> UncapturableOpError:
    return UncapturableOpError(
        f"a random op in this graph segment cannot be captured with random_ops='error' ({cause}). "
        "Capture with random_ops='break' (the default), which makes every random op an eager break "
        "that draws fresh numbers at each replay, or move it into an @breakgraph.eager_on_graph function."
    )


def uncapturable(what: str, cause: BaseException | None = None) -> UncapturableOpError:
    detail = f" ({cause})" if cause is not None else ""
    return UncapturableOpError(f"{what} cannot be captured in a CUDA graph segment{detail}. {REMEDY}")


def _touches_cuda(args, kwargs) -> bool:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.is_cuda:
            return True
    return False


class _Kind:
    PLAIN, RANDOM, HOST_SYNC = range(3)


_kinds: dict = {}


def _kind(func) -> int:
    kind = _kinds.get(func)
    if kind is None:
        if func in _HOST_SYNC_OPS:
            kind = _Kind.HOST_SYNC
        elif torch.Tag.nondeterministic_seeded in func.tags:
            kind = _Kind.RANDOM
        else:
            kind = _Kind.PLAIN
        _kinds[func] = kind
    return kind


class CaptureDispatchMode(TorchDispatchMode):
    """Active for the whole capture; acts only while a graph segment is open."""

    def __init__(self, capture: ActiveCapture):
        super().__init__()
        self.capture = capture

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        capture = self.capture
        if not capture.segment_open:  # inside an eager break: plain eager semantics
            return func(*args, **kwargs)
        kind = _kind(func)
        if kind == _Kind.RANDOM:
            return capture.run_break(func, args, kwargs, name=f"random {func}")
        if kind == _Kind.HOST_SYNC and _touches_cuda(args, kwargs):
            raise uncapturable(f"{func} (it synchronizes the GPU with the host)")
        try:
            return func(*args, **kwargs)
        except RuntimeError as error:
            if is_capture_violation(error):
                raise uncapturable(str(func), error) from error
            raise


def clearer_error(error: BaseException) -> UncapturableOpError | None:
    """CUDA's or torch's bare refusal of an op during capture, as an error that names the
    remedy; None when ``error`` is something else (or already says it)."""
    if isinstance(error, UncapturableOpError):
        return None
    if is_random_op_refusal(error):
        return random_op_uncapturable(error)
    if is_capture_violation(error):
        return uncapturable("an operation in this graph segment", error)
    return None
