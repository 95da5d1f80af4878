"""What a conditional node's body may not hold, refused before CUDA sees it.

A body is one graph the GPU runs with no stop for the host. A body capture in
which CUDA refused an operation cannot be ended without crashing the driver
(NVBUG 6805256), so what CUDA would refuse is caught first: random ops, host
syncs (some hidden inside a kernel: boolean-mask indexing, ops that size their
output on the host), host-GPU copies and collectives at the op level, and
torch's ``synchronize`` calls on the capturing thread.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from breakgraph.base import trees
from breakgraph.recording.dispatch import UncapturableOpError, is_collective
from breakgraph.recording.op_watch import OpKind, op_kind, touches_cuda

_aten = torch.ops.aten
# Indexing with a boolean mask counts the mask's True values on the host (nonzero) inside
# the kernel, where no op watch sees it.
_MASKABLE = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default, _aten._index_put_impl_.default}
# Ops whose CUDA kernels read a count back to the host to size their output.
_SIZED_ON_THE_HOST = {_aten.bincount.default, _aten._unique2.default, _aten.unique_dim.default, _aten.unique_consecutive.default}
_COPIES = {_aten._to_copy.default, _aten.copy_.default, _aten._copy_from.default}


def needs_the_host(func, args, kwargs) -> str | None:
    """What in the op ``func`` needs the host, which a body cannot stop for; None if nothing."""
    if func in _COPIES:
        source = args[0].device
        target = kwargs.get("device") or source if func is _aten._to_copy.default else args[1].device
        if {source.type, torch.device(target).type} == {"cpu", "cuda"}:
            return f"{func} (a copy between the host and the GPU)"
        return None
    if not touches_cuda(args, kwargs):
        return None
    sized_on_the_host = func in _SIZED_ON_THE_HOST or (func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is None)
    masked = func in _MASKABLE and any(isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8) for index in args[1])
    if op_kind(func) == OpKind.HOST_SYNC or sized_on_the_host or masked:
        return f"{func} (it synchronizes the GPU with the host)"
    return None


def refusal(what: str, construct: str, function: str, fix: str) -> UncapturableOpError:
    return UncapturableOpError(
        f"{what} cannot go inside {construct}'s {function}: the GPU runs it as one graph, with no stop for "
        f"the host. {fix}, or make the whole {construct} an eager break (call it from an "
        "@breakgraph.eager_on_graph function)."
    )


class BodyWatch(TorchDispatchMode):
    """The op watch of one body's capture: refuses random ops, host syncs and collectives
    before CUDA sees them, and notes the storages the body's ops made."""

    def __init__(self, construct: str, function: str):
        super().__init__()
        self.construct, self.function = construct, function
        self._made: set[int] = set()

    def made(self, tensor: torch.Tensor) -> bool:
        """Whether an op of this body made ``tensor``'s storage (never said of an empty one:
        every empty tensor's storage is at address 0)."""
        return tensor.numel() > 0 and tensor.untyped_storage().data_ptr() in self._made

    def refuse(self, what: str, fix: str) -> UncapturableOpError:
        return refusal(what, self.construct, self.function, fix)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if op_kind(func) == OpKind.RANDOM:
            raise self.refuse(f"the random op {func}", "Draw the numbers before the call and pass them in")
        host_work = needs_the_host(func, args, kwargs)
        if host_work is not None:
            raise self.refuse(host_work, "Keep the value on the GPU")
        if is_collective(func):
            raise self.refuse(f"the collective {func}", "Run it before or after the call")
        result = func(*args, **kwargs)
        leaves, _ = trees.flatten((args, kwargs), objects=False)
        inputs = {value.untyped_storage().data_ptr() for value in leaves if isinstance(value, torch.Tensor)}
        for value in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() not in inputs:
                self._made.add(value.untyped_storage().data_ptr())
        return result


_SYNCHRONIZERS = ((torch.cuda, "synchronize", "torch.cuda.synchronize()"), (torch.cuda.Stream, "synchronize", "Stream.synchronize()"), (torch.cuda.Event, "synchronize", "Event.synchronize()"))


class SynchronizeRefusal:
    """torch's synchronize calls, refused on a thread while it captures a body (CUDA would
    refuse them and lose the body): installed once for every thread that captures one,
    reference-counted under a lock, and calling through on every other thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self._users = 0
        self._originals: list = []
        self._watches = threading.local()  # this thread's bodies being captured, innermost last

    @contextlib.contextmanager
    def during(self, watch: BodyWatch):
        with self._lock:
            if self._users == 0:
                for owner, name, label in _SYNCHRONIZERS:
                    original = owner.__dict__[name]
                    self._originals.append((owner, name, original))
                    setattr(owner, name, self._refusing(original, label))
            self._users += 1
        watches = self._watches.__dict__.setdefault("stack", [])
        watches.append(watch)
        try:
            yield
        finally:
            watches.pop()
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    for owner, name, original in self._originals:
                        setattr(owner, name, original)
                    self._originals.clear()

    def _refusing(self, original: Callable, label: str) -> Callable:
        def call(*args, **kwargs):
            watches = getattr(self._watches, "stack", None)
            if watches:
                raise watches[-1].refuse(label, "Keep the value on the GPU")
            return original(*args, **kwargs)

        return call


synchronize_refusal = SynchronizeRefusal()
