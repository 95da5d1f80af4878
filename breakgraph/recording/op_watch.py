"""The op watch: random ops and host-sync ops met while a segment records.

A random op goes to the capture (:meth:`ActiveCapture.random_op`), which
records it in a segment torch captures (:mod:`breakgraph.recording.rng`) or
makes it an eager break with ``random_ops="break"``; a host-sync op on a GPU
tensor is named before it reaches CUDA. Every other op passes untouched.

The watch is a Python kernel registered, for only those ops, at a dispatch
key of its own that the capturing thread switches on: every other op falls
through it inside the dispatcher, so watching costs nothing per plain op
(a ``TorchDispatchMode`` costs a Python call per op, about 10 µs). Where that
key is taken or missing in this torch, or torch.compile has compiled code in
the process (:func:`watch_ops` says why), the watch is such a mode instead:
slower, the same behaviour.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from typing import Callable, ContextManager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from breakgraph.base import context
from breakgraph.base.context import ActiveCapture
from breakgraph.recording.dispatch import is_capture_violation, uncapturable

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


class OpKind:
    """What the op watch makes of an op: :func:`op_kind`."""

    PLAIN, RANDOM, HOST_SYNC = range(3)


_kinds: dict = {}


def op_kind(func) -> int:
    """Whether ``func`` draws random numbers, synchronizes with the host (on CUDA tensors), or neither."""
    kind = _kinds.get(func)
    if kind is None:
        if func in _HOST_SYNC_OPS:
            kind = OpKind.HOST_SYNC
        elif torch.Tag.nondeterministic_seeded in func.tags:
            kind = OpKind.RANDOM
        else:
            kind = OpKind.PLAIN
        _kinds[func] = kind
    return kind


def touches_cuda(args, kwargs) -> bool:
    """Whether any tensor argument is on a GPU (a host-sync op on CPU tensors syncs nothing)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.is_cuda:
            return True
    return False


def _watched(capture: ActiveCapture, func, kind: int, call: Callable, args: tuple, kwargs: dict):
    """What the watch does with ``func`` (of ``kind``) inside a segment; ``call`` runs it below the watch."""
    if kind == OpKind.RANDOM:
        return capture.random_op(func, call, args, kwargs)
    if kind == OpKind.HOST_SYNC and touches_cuda(args, kwargs):
        raise uncapturable(f"{func} (it synchronizes the GPU with the host)")
    return call(*args, **kwargs)


def _outside_segments(capture: ActiveCapture | None) -> bool:
    """Plain eager semantics: no capture, an eager break, or a conditional body (its own watch refuses)."""
    return capture is None or not capture.segment_open or capture.body_depth > 0


class _KeyWatch:
    """The watch as kernels at the dispatch key ``KEY``, for the random and host-sync ops only.

    torch reserves the key for tests of the dispatcher and registers nothing at
    it. It sits above autograd, so a watched op is seen as the user called it,
    and once: the ops it calls run with the key off. The ops of every library
    are registered as the first capture watches, and those defined since
    (``torch.library``, ``torch.ops.load_library``) as a later one does; an op
    a C++ extension registers at its import, after the first capture, is not seen.
    """

    KEY = "TESTING_ONLY_GenericMode"

    def __init__(self):
        self._lock = threading.Lock()
        self._libraries: dict[str, torch.library.Library] | None = None  # None: not tried yet; {}: unavailable
        self._watched: set = set()
        self._defined = (-1, -1)  # how many ops Python had defined and libraries loaded at the last look

    def available(self) -> bool:
        """Register the kernels on first use, and for the ops defined since on later ones;
        False where the key is taken or missing in this torch."""
        if self._to_register():
            with self._lock:
                if self._to_register():
                    self._register()
        return bool(self._libraries)

    def on(self) -> ContextManager:
        """Switch the key on for this thread: the watched ops reach the kernels until it is off."""
        return torch._C._IncludeDispatchKeyGuard(self._key)

    def _to_register(self) -> bool:
        return self._libraries is None or (bool(self._libraries) and _ops_defined() != self._defined)

    def _register(self) -> None:
        """The first time, all or nothing: the fallthrough and every op's kernel, or none and
        ``{}`` (the mode watches instead). Later, the ops defined since, each or not: libraries
        in use are never dropped (that would unregister the fallthrough under a running capture),
        and an op that cannot be registered is not seen (torch refuses it in a segment)."""
        defined = _ops_defined()
        if self._libraries is None:
            try:
                self._libraries = self._first_libraries()
            except (RuntimeError, AttributeError, TypeError):
                self._libraries, self._watched = {}, set()
        else:
            for func in _watched_ops():
                if func not in self._watched:
                    with contextlib.suppress(RuntimeError, AttributeError, TypeError):
                        self._watch(self._libraries, func)
        self._defined = defined

    def _first_libraries(self) -> dict:
        self._key = torch._C._parse_dispatch_key(self.KEY)
        if self._key is None or torch._C._dispatch_has_backend_fallback(self._key):
            return {}
        self._below = torch._C._dispatch_keyset_full_after(self._key)
        libraries = {"_": torch.library.Library("_", "IMPL")}
        libraries["_"].fallback(torch.library.fallthrough_kernel, self.KEY)
        for func in _watched_ops():
            self._watch(libraries, func)
        return libraries

    def _watch(self, libraries: dict, func) -> None:
        """Register ``func``'s kernel, in its namespace's library."""
        namespace = func.namespace
        if namespace not in libraries:
            libraries[namespace] = torch.library.Library(namespace, "IMPL")
        libraries[namespace].impl(func, self._kernel(func, op_kind(func), self._below), self.KEY, with_keyset=True)
        self._watched.add(func)

    def _kernel(self, func, kind: int, below) -> Callable:
        unwatched = torch._C.DispatchKeySet(self._key)

        def call(keyset, *args, **kwargs):
            with torch._C._ExcludeDispatchKeyGuard(unwatched):  # the ops it calls are part of it
                return func.redispatch(keyset & below, *args, **kwargs)

        def kernel(keyset, *args, **kwargs):
            capture = context.current()
            if _outside_segments(capture):
                return call(keyset, *args, **kwargs)
            return _watched(capture, func, kind, functools.partial(call, keyset), args, kwargs)

        return kernel


def _ops_defined() -> tuple[int, int]:
    """How many ops Python has defined (``torch.library``) and libraries torch has loaded:
    where either grew, ops may have come that the watch does not know."""
    return len(torch.library._defs), len(torch.ops.loaded_libraries)


def _watched_ops() -> list:
    """Every op overload, of every library, that draws random numbers or synchronizes with
    the host; a composite op that only calls others is left to them (it has no kernel of its own)."""
    ops = []
    for name in torch._C._dispatch_get_all_op_names():
        namespace, _, rest = name.partition("::")
        packet_name, _, overload = rest.partition(".")
        try:
            func = getattr(getattr(getattr(torch.ops, namespace), packet_name), overload or "default")
        except (AttributeError, RuntimeError):
            continue
        if op_kind(func) == OpKind.PLAIN:
            continue
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            continue
        ops.append(func)
    return ops


_key_watch = _KeyWatch()


class CaptureDispatchMode(TorchDispatchMode):
    """The watch as a ``TorchDispatchMode``, where the dispatch key is not to be had.

    It also names any op CUDA refuses in a segment (the key's watch leaves those
    to :func:`~breakgraph.recording.dispatch.clearer_error`, at the capture's end).
    """

    def __init__(self, capture: ActiveCapture):
        super().__init__()
        self.capture = capture

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _outside_segments(self.capture):
            return func(*args, **kwargs)
        kind = op_kind(func)
        try:
            return _watched(self.capture, func, kind, func, args, kwargs)
        except RuntimeError as error:
            # A random op's refusal is left to clearer_error, which knows its fix.
            if kind != OpKind.RANDOM and is_capture_violation(error):
                raise uncapturable(str(func), error) from error
            raise


def watch_ops(capture: ActiveCapture) -> ContextManager:
    """The op watch for ``capture``, on this thread while the returned context is entered.

    The key's watch, unless torch.compile has compiled code in this process: Dynamo's guards
    check the thread's dispatch keys, so code compiled without the key would compile again
    inside the capture, where compiling fails. They leave a dispatch mode's keys out."""
    if _key_watch.available() and not dynamo_compiled():
        return _key_watch.on()
    return CaptureDispatchMode(capture)


def dynamo_compiled() -> bool:
    """Whether Dynamo has compiled a frame in this process (where it cannot tell, True)."""
    convert_frame = sys.modules.get("torch._dynamo.convert_frame")
    return convert_frame is not None and getattr(convert_frame, "FRAME_COUNTER", 1) > 0
