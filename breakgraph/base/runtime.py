"""What the process offers a capture: the GPU, the environment switches and capture
streams.

Everything here is process-wide (or per thread), so the context manager,
``graphed`` and the runner share one copy of it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import warnings
from typing import Callable, TypeVar

import torch

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


def _env_flag(name: str) -> bool:
    """Whether the switch ``name`` is on; a value that is neither on nor off is taken as off,
    with a warning, rather than silently."""
    value = os.environ.get(name, "").strip().lower()
    if value not in _TRUE and value not in _FALSE:
        warn_user(f"{name}={os.environ[name]!r} is neither on (1, true, yes, on) nor off (0, false, no, off): taken as off. Set one of those.")
    return value in _TRUE


def _switch_as_set(name: str) -> str:
    """``name=value`` as the environment has it, for messages that blame the switch."""
    return f"{name}={os.environ.get(name, '').strip()}"


def debug_requested(explicit: bool | None = None) -> bool:
    """``explicit`` when given, else ``BREAKGRAPH_DEBUG=1``."""
    if explicit is None:
        return _env_flag("BREAKGRAPH_DEBUG")
    if not isinstance(explicit, bool):
        raise TypeError(f"debug must be True, False or None (None: BREAKGRAPH_DEBUG=1 decides), got {explicit!r}")
    return explicit


def capture_disabled() -> bool:
    """``BREAKGRAPH_DISABLE=1``: callable forms run eagerly (an A/B switch)."""
    return _env_flag("BREAKGRAPH_DISABLE")


def cuda_mismatch(torch_cuda: str | None, bindings_version: str) -> str | None:
    """What to install when cuda-bindings is built for another CUDA major version than torch
    (``torch.version.cuda``), in words a user can act on; None when they match or torch
    has no CUDA."""
    if not torch_cuda:
        return None
    torch_major, bindings_major = torch_cuda.split(".")[0], bindings_version.split(".")[0]
    if torch_major == bindings_major:
        return None
    return (
        f"torch {torch.__version__} is built for CUDA {torch_cuda}, but cuda-bindings {bindings_version} is for "
        f"CUDA {bindings_major}: pip install 'cuda-bindings=={torch_major}.*' (or breakgraph[cu{torch_major}])"
    )


@functools.cache
def cuda_problem() -> str | None:
    """Why breakgraph cannot use a GPU here, in words a user can act on; None when it can.
    A cuda-bindings release for another CUDA major than torch's is named once, as a warning,
    when the GPU works anyway (a driver new enough for both)."""
    if not torch.cuda.is_available():
        return "no CUDA GPU is available"
    import breakgraph_bindings as bindings
    from cuda.bindings import __version__ as bindings_version

    try:
        bindings.probe_devices()
    except bindings.CudaError as error:
        major = (torch.version.cuda or "").split(".")[0]
        fix = f": pip install 'cuda-bindings=={major}.*'" if major else ""
        return (
            f"torch {torch.__version__} sees {torch.cuda.device_count()} GPU(s) through CUDA {torch.version.cuda}, "
            f"but cuda-bindings {bindings_version} cannot use them ({error}); install the cuda-bindings "
            f"release that matches torch's CUDA{fix}"
        )
    mismatch = cuda_mismatch(torch.version.cuda, bindings_version)
    if mismatch is not None:
        warnings.warn(f"breakgraph: {mismatch}; mixing CUDA major versions is untested", stacklevel=2)
    return None


def cuda_available() -> bool:
    """True when torch sees a GPU and cuda-python can talk to its driver."""
    return cuda_problem() is None


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# torch's decorator forms of no_grad and inference_mode, which breakgraph's entry points wear:
# a warning passes through their wrapper to the user's line.
_TORCH_DECORATORS = torch.utils._contextlib.__file__


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` pointing at the first line outside breakgraph: a
    runner that ``hf.Generator`` makes warns at the line that made the Generator, the user's."""
    frame, level = sys._getframe(1), 2  # stacklevel 2: warn_user's caller
    while frame is not None and (frame.f_code.co_filename.startswith(_PACKAGE) or frame.f_code.co_filename == _TORCH_DECORATORS):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def eager_fallback_reason() -> str | None:
    """Why the callable forms run eagerly here (no usable GPU, or ``BREAKGRAPH_DISABLE=1``), or None."""
    if capture_disabled():
        return f"{_switch_as_set('BREAKGRAPH_DISABLE')} is set"
    return cuda_problem()


def require_cuda(what: str) -> None:
    """Refuse what only a GPU can do, saying so (rather than torch's dummy-class errors)."""
    problem = cuda_problem()
    if problem is not None:
        raise RuntimeError(f"{what} needs a CUDA GPU: {problem}")


def require_capture(what: str) -> None:
    """Refuse a capture that cannot happen here, pointing to the callable form that can."""
    if capture_disabled():
        raise RuntimeError(
            f"{_switch_as_set('BREAKGRAPH_DISABLE')} is set, and {what} cannot be re-run eagerly at replay. Use "
            "breakgraph.graphed(fn, *args) (or GraphRunner), which falls back to calling fn eagerly."
        )
    problem = cuda_problem()
    if problem is not None:
        raise RuntimeError(
            f"{what} needs a CUDA GPU ({problem}). Use breakgraph.graphed(fn, *args) (or GraphRunner) "
            "instead: without a GPU it calls fn eagerly on every replay, so the same code runs everywhere."
        )


def as_cuda_stream(stream):
    """``stream`` as a ``torch.cuda.Stream``, where it is torch's device-generic ``torch.Stream``
    of a GPU (what ``torch.accelerator.current_stream()`` returns), which torch's CUDA methods
    take too: breakgraph knows a stream by its ``cuda_stream`` handle. Anything else is
    returned as it is, for the caller to judge."""
    if type(stream) is torch.Stream and stream.device.type == "cuda":  # torch.cuda.Stream subclasses it
        return torch.cuda.Stream(stream_id=stream.stream_id, device_index=stream.device_index, device_type=stream.device_type)
    return stream


_own_streams: dict[int, list[torch.cuda.Stream]] = {}  # device index -> capture streams breakgraph made
_claims: dict[int, tuple[int, str, int]] = {}  # stream handle -> (thread id, thread name, depth)
_claims_lock = threading.Lock()


@contextlib.contextmanager
def claim_capture_stream(device: torch.device, stream: torch.cuda.Stream | None = None):
    """Hold ``stream`` (by default a capture stream of breakgraph's own) for one capture on
    ``device``, and yield it. A thread may claim a stream it holds again; a stream another
    thread's capture holds is refused with a clear error (CUDA's would not be). breakgraph's
    own streams are made outside torch's pool, which hands its 32 streams per device out
    again (to NCCL's internal stream, to a model's ``torch.cuda.Stream()``), so no other
    code queues work on them; one is made for each capture that runs at once."""
    thread, name = threading.get_ident(), threading.current_thread().name
    with _claims_lock:
        if stream is None:
            stream = _free_own_stream(device)
        handle = stream.cuda_stream
        owner, owner_name, depth = _claims.get(handle, (thread, name, 0))
        if owner != thread:
            raise RuntimeError(
                f"stream {handle:#x} is already being captured on by another capture (thread {owner_name!r}). "
                "Give each concurrent capture a stream of its own, and keep it alive while it captures: "
                "torch hands its pooled streams (torch.cuda.Stream()) out again, 32 per device."
            )
        _claims[handle] = (thread, name, depth + 1)
    try:
        yield stream
    finally:
        with _claims_lock:
            _, _, depth = _claims.pop(handle)
            if depth > 1:
                _claims[handle] = (thread, name, depth - 1)


def _free_own_stream(device: torch.device) -> torch.cuda.Stream:
    """One of breakgraph's own capture streams on ``device`` that no capture holds, made
    if all are held (call under ``_claims_lock``). Kept for the process's life: the
    allocator's blocks remember their stream."""
    streams = _own_streams.setdefault(device.index, [])
    for stream in streams:
        if stream.cuda_stream not in _claims:
            return stream
    streams.append(own_stream(device))
    return streams[-1]


def own_stream(device: torch.device) -> torch.cuda.Stream:
    """A new non-blocking stream on ``device`` that torch's pool never hands out."""
    import breakgraph_bindings as bindings

    with torch.cuda.device(device):
        return torch.cuda.ExternalStream(bindings.new_stream(), device=device)


_body_streams = threading.local()


def body_stream(device: torch.device, depth: int) -> torch.cuda.Stream:
    """This thread's stream for capturing conditional bodies ``depth`` levels deep on
    ``device``: one per depth, since a body's capture stays open while a body inside it
    is captured. Made outside torch's pool, which would hand a capturing stream out
    again, and kept for the thread's life: the allocator's blocks remember their stream."""
    kept = _body_streams.__dict__.setdefault("by_device", {}).setdefault(device.index, [])
    while len(kept) <= depth:
        kept.append(own_stream(device))
    return kept[depth]


def abandon_body_stream(device: torch.device, depth: int) -> None:
    """Never use the body stream at ``depth`` again: its capture was invalidated, and ending
    it would crash the driver (NVBUG 6805256), so it stays open on a stream nobody uses."""
    _body_streams.by_device[device.index][depth:] = []


@contextlib.contextmanager
def on_stream(stream: torch.cuda.Stream):
    """``with torch.cuda.stream(stream)`` without building torch's stream objects (a
    fraction of its cost: docs/performance.md), for the paths every capture takes: ``stream`` becomes current on its device,
    which becomes the current device, and on exit both are what they were."""
    device = torch.cuda.current_device()
    index = stream.device_index
    previous = [torch._C._cuda_getCurrentStream(index)]  # (stream id, device index, device type)
    if device != index:
        previous.append(torch._C._cuda_getCurrentStream(device))  # restored last: it makes `device` current
    torch._C._cuda_setStream(stream_id=stream.stream_id, device_index=index, device_type=stream.device_type)
    try:
        yield stream
    finally:
        for stream_id, device_index, device_type in previous:
            torch._C._cuda_setStream(stream_id=stream_id, device_index=device_index, device_type=device_type)


def run_on_stream(stream: torch.cuda.Stream, function: Callable[[], T]) -> T:
    """``function()`` with ``stream`` current, ordered after the current stream's queued
    work and before its later work (a side stream's fork and join)."""
    caller = torch.cuda.current_stream(stream.device_index)
    stream.wait_stream(caller)
    with on_stream(stream):
        result = function()
    caller.wait_stream(stream)
    return result
