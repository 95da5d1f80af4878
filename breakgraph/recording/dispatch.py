"""What a capture makes of single torch ops that cannot be recorded as they are.

The op watch (:mod:`breakgraph.recording.op_watch`) takes random ops and
names host-sync ops. An op that CUDA or torch refuses where the watch does
not look (``print(tensor)``, ``torch.cuda.synchronize()``, any op in a capture
with ``random_ops="error"``) fails with the refusal turned into an :class:`UncapturableOpError` that
points at the user's line and says how to fix it (:func:`clearer_error`).
A capture that CUDA invalidated from outside (another thread's device-wide
synchronize) fails with a :class:`CaptureInvalidatedError` that says so.
"""

from __future__ import annotations

import os
import re
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import breakgraph_bindings as bindings

# CUDA refusing an operation in a capture; an invalidated capture (_INVALIDATED) is not among them.
_CAPTURE_VIOLATION = re.compile(
    r"operation not permitted when stream is capturing"
    r"|cudaErrorStreamCapture(?!Invalidated)"
    r"|depend on a capturing blocking stream"
    r"|CUDA generator not in capture mode"
)

# A library creating its handle at its first use in a thread, which allocates device memory a
# capture refuses: torch's words for cuBLAS and cuBLASLt, and for cuSOLVER (with a comma).
_LAZY_HANDLE = re.compile(r"_STATUS_NOT_INITIALIZED,? when calling `\w+Create")

_INVALIDATED = re.compile(r"previous error during capture|cudaErrorStreamCaptureInvalidated")

REMEDY = (
    "Move it into a function decorated with @breakgraph.eager_on_graph: that function "
    "runs eagerly between graph segments, at capture and at every replay."
)

# Frames in these folders are not the user's line: torch, the bindings, the engine.
_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(module.__file__)) + os.sep for module in (torch, bindings)) + (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
)


class UncapturableOpError(RuntimeError):
    """An op inside a graph segment cannot be captured into a CUDA graph."""


class CaptureInvalidatedError(RuntimeError):
    """CUDA invalidated a capture from outside the work it recorded: a device-wide
    synchronize, or work on the legacy default stream, in another thread while it ran."""


def is_capture_invalidated(error: BaseException) -> bool:
    """Whether ``error`` is CUDA reporting a capture an earlier failure invalidated; the
    first such error a capture raises means the failure was not an op it recorded."""
    return isinstance(error, RuntimeError) and bool(_INVALIDATED.search(str(error)))


def is_capture_violation(error: BaseException) -> bool:
    """Whether ``error`` is CUDA refusing an operation because a stream is capturing."""
    return isinstance(error, RuntimeError) and bool(_CAPTURE_VIOLATION.search(str(error)))


# torch's refusal of a random op in a capture that has no graph-safe state for its generator:
# 2.11 and earlier ("... CUDA generator not in capture mode"), 2.12 and 2.13 ("RNG op during
# graph capture but generator is not registered with the capturing graph"), 2.14 ("RNG op
# during graph capture but could not find the CUDAGraph object").
_RANDOM_REFUSAL = re.compile(r"CUDA generator not in capture mode|RNG op during graph capture")


def is_random_op_refusal(error: BaseException | None) -> bool:
    """Whether ``error`` is torch refusing a random op in a capture that cannot draw from
    its generator (a capture torch did not begin, or a generator it does not know)."""
    return isinstance(error, RuntimeError) and bool(_RANDOM_REFUSAL.search(str(error)))


def user_line(error: BaseException) -> str:
    """The user's line that issued the refused op: the innermost frame outside torch and breakgraph."""
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if not frame.filename.startswith(_LIBRARY_DIRS) and "<frozen" not in frame.filename:
            code = f"`{frame.line.strip()}` " if frame.line else ""
            return f"{code}({os.path.basename(frame.filename)}:{frame.lineno})"
    return "an operation in this graph segment"


def uncapturable(what: str, cause: BaseException | None = None) -> UncapturableOpError:
    detail = f" ({cause})" if cause is not None else ""
    return UncapturableOpError(f"{what} cannot be captured in a CUDA graph segment{detail}. {REMEDY}")


def clearer_error(error: BaseException, random_ops: str) -> RuntimeError | None:
    """CUDA's or torch's bare refusal of an op during capture, as an error that names the
    user's line and the remedy, or CUDA's report of a capture invalidated from outside,
    as one that names the likely cause; None when ``error`` is something else (or
    already says it)."""
    if isinstance(error, (UncapturableOpError, CaptureInvalidatedError)):
        return None
    if is_random_op_refusal(error):
        if random_ops == "error":
            fix = (
                "Capture with random_ops='graph' (the default), which captures random ops into the "
                "segment with fresh numbers at each replay"
            )
        else:
            fix = (
                "It draws from a generator the capture was not given (only the device's default "
                "generator is, unless you pass generators=[...]): pass the generator in "
                "generators= to the capture, graphed or GraphRunner. Or the op watch did not see it: "
                "an op not tagged torch.Tag.nondeterministic_seeded, or one a C++ extension registered "
                "after the process's first capture: make it an eager break"
            )
        return UncapturableOpError(
            f"the random op at {user_line(error)} cannot be captured with random_ops={random_ops!r} "
            f"({error}). {fix}, or move it into an @breakgraph.eager_on_graph function."
        )
    if isinstance(error, RuntimeError) and _LAZY_HANDLE.search(str(error)):
        return UncapturableOpError(
            f"{user_line(error)} is its library's first use in this thread on this device, which creates a handle "
            f"and allocates memory a capture cannot hold ({error}). Run the captured code once eagerly first, in "
            "the thread that captures (graphed's warmup=1 does), and capture again: nothing of this "
            "capture is left behind."
        )
    if is_capture_invalidated(error):
        return CaptureInvalidatedError(
            f"the CUDA capture was invalidated from outside the work it recorded ({error}). Most often another "
            "thread synchronized while it ran: a device-wide torch.cuda.synchronize() invalidates a capture in "
            "every capture mode (torch.cuda.graph's too), and under capture_error_mode='global' (the default) so "
            "does any call CUDA deems unsafe in any thread, a stream's synchronize() included. Capture with "
            "capture_error_mode='thread_local' while other threads work, have them synchronize their own streams "
            "or events rather than the device, and capture again: nothing of this capture is left behind. If this "
            "thread caught an earlier CUDA error of this capture and went on, that error is the cause."
        )
    if is_capture_violation(error):
        return uncapturable(
            f"{user_line(error)} synchronizes with the host or calls a CUDA function that stream capture "
            "forbids; it",
            error,
        )
    return None


# Ops of torch.distributed that issue no collective of their own: the end of one, and a wrapper.
_NOT_COLLECTIVES = {"_c10d_functional::wait_tensor", "_c10d_functional::_wrap_tensor_autograd"}


def is_collective(func) -> bool:
    """Whether the op ``func`` issues a collective of torch.distributed."""
    name = func._schema.name
    return name.startswith(("c10d::", "_c10d_functional::")) and name not in _NOT_COLLECTIVES


class BarrierBeforeCollectives(TorchDispatchMode):
    """Calls ``barrier`` before each collective an eager break issues at capture (``barrier_fn``).

    A break's collectives run for real at capture. Were a rank's break to fail
    before its collective, the other ranks' copy of it would wait on their GPUs
    for a partner that never comes, and their next collective would pair with
    the wrong one. The barrier before each collective tells every rank of the
    failure first, so that no rank issues it.
    """

    def __init__(self, barrier):
        super().__init__()
        self.barrier = barrier
        self.collectives = 0  # met so far

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if is_collective(func):
            self.collectives += 1
            self.barrier()
        return func(*args, **(kwargs or {}))
