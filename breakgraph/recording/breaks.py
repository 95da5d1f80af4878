"""An eager break: how it runs at capture, how it is recorded, with nothing that pins
memory, and how it replays.

At capture it runs eagerly (:func:`run_eagerly`, which in debug mode warns of
what it keeps in the graph's pool), or, in a full-graph capture, its
capturable variant runs inside the segment (:func:`run_inline`). Arguments
are kept as non-owning aliases (containers walked, objects kept by
reference), the result as aliases when it is only CUDA tensors, plus the
writer that puts every replay's result where later segments read it. A
backward that reaches autograd history made inside the break is refused,
and the autocast state it ran under is kept for replay. The recorded break
is a segment kind of its own (:class:`EagerSegment`): its function called on
those arguments, then its result written back.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from breakgraph.base import trees
from breakgraph.recording.break_ordering import BreakOrdering
from breakgraph.recording.aliasing import alias_leaves, alias_result, alias_tensor, is_plain_tensor
from breakgraph.recording.dispatch import UncapturableOpError, is_capture_violation
from breakgraph.recording.outputs import check_output
from breakgraph.base.pool import PoolUsage
from breakgraph.recording.segments import ReplaySource, Segment
from breakgraph.recording.writeback import Writer, make_writer


@dataclass(eq=False)
class EagerSegment(Segment):
    """An eager break: ``function`` replayed on aliases of its capture-time arguments.

    ``result`` is the capture-time result (aliases of its tensors when it is
    only CUDA tensors, see :func:`~breakgraph.recording.aliasing.alias_result`); ``write``
    copies each replay's result into it, where later segments read it.
    ``argument_addresses`` (path, weak references to the tensor and its
    storage, data pointer, whether the graph's pool holds it) lets debug mode
    check that the caller's tensors did not move or die. ``ordering``: what it orders
    at replay for events and streams that crossed its boundaries (None: none did), set
    by the capture's break watch, or later by a segment's wait on a stream it worked on.
    """

    kind: ClassVar[str] = "eager"

    function: Callable
    args: tuple
    kwargs: dict
    write: Writer
    ordering: BreakOrdering | None = None

    def emit(self, source: ReplaySource) -> None:
        if self.ordering is not None and self.ordering.runs_before:
            source.python(f"{source.bind('follow', self.ordering.before)}({source.bind('stream', source.stream)})")
        self._emit_call(source)
        if self.ordering is not None and self.ordering.has_signals:
            source.python(f"{source.bind('signal', self.ordering.after)}()")

    def _emit_call(self, source: ReplaySource) -> None:
        arguments = f"*{source.bind('args', self.args)}"
        if self.kwargs:
            arguments += f", **{source.bind('kwargs', self.kwargs)}"
        call = f"{source.bind('function', self.function)}({arguments})"
        writer = source.bind("write", self.write)
        if self.writes_back and self.ordering is not None and self.ordering.orders_writeback:
            ordering, stream = source.bind("ordering", self.ordering), source.bind("stream", source.stream)
            source.python(
                f"result = {call}",
                f"{ordering}.before_writeback({stream})",
                f"{source.bind('segment', self)}.bytes_written = {writer}(result)",
                f"{ordering}.after_writeback({stream})",
            )
        elif self.writes_back:
            source.python(f"{source.bind('segment', self)}.bytes_written = {writer}({call})")
        else:  # nothing to write (bytes_written stays 0): the writer only raises, where the type is not the captured one
            expected = source.bind("result_type", self.write.result_type)
            source.python(f"result = {call}", f"if type(result) is not {expected}:", f"    {writer}(result)")

    @property
    def writes_back(self) -> bool:
        """Whether each replay copies a result into buffers later segments read."""
        return self.write.result_type is None

    def table_cells(self) -> dict[str, Any]:
        return {"nodes": "", "bytes_written": self.bytes_written}

    def dot_node(self) -> str:
        label = f"eager {self.index}\\n{self.name}()".replace('"', "'")
        return f'shape=ellipse, label="{label}"'

    def release(self) -> None:
        self.args, self.kwargs, self.result = (), {}, None


class LifetimeWarning(UserWarning):
    """Debug mode: a break keeps tensors, made during capture, that its result does not hold."""


def warn_kept_allocations(name: str, before: dict[int, int], after: dict[int, int], held) -> None:
    """Warn when the pool blocks a break allocated during capture outlive it outside ``held``
    (its result, and the tensors autograd saved for a backward it will refuse anyway).

    ``before`` and ``after``: the pool's allocated blocks around the break's
    call. Such a tensor (stored in a global or an attribute) is read by later
    graph segments at its capture-time address, while every replay of the
    break makes a new one elsewhere: those segments then read stale memory.
    """
    pointers = [leaf.untyped_storage().data_ptr() for leaf in trees.flatten(held, objects=True)[0] if isinstance(leaf, torch.Tensor)]
    kept = {
        address: size
        for address, size in after.items()
        if address not in before and not any(address <= pointer < address + size for pointer in pointers)
    }
    if kept:
        warnings.warn(
            f"{name}() kept {len(kept)} tensor(s) ({sum(kept.values())} bytes) that it allocated during capture "
            "outside its result (in a global or an attribute?). Graph segments that read them keep reading "
            "these capture-time addresses, while every replay of the break makes new ones: return them from "
            "the break instead.",
            LifetimeWarning,
            stacklevel=2,
        )


def run_eagerly(name: str, run: Callable, args: tuple, kwargs: dict, pool: torch.cuda.MemPool | None) -> tuple[Any, PoolUsage | None]:
    """``run(*args, **kwargs)`` as the break ``name``, and None; with ``pool`` (debug mode), the
    pool's usage before it in place of None, having warned of what it allocated there and kept
    outside its result."""
    if pool is None:
        return run(*args, **kwargs), None
    before, saved = PoolUsage.of(pool), []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        result = run(*args, **kwargs)
    after = PoolUsage.of(pool)
    warn_kept_allocations(name, before.allocated_blocks(), after.allocated_blocks(), (result, saved))
    return result, before


def run_inline(name: str, function: Callable, inline: Callable | bool | None, args: tuple, kwargs: dict) -> Any:
    """The break ``name`` in a full-graph capture: its capturable variant ``inline`` (True:
    ``function`` itself) recorded in the open segment; refused where it has none or CUDA
    refuses what it does."""
    fix = "capture with breaks='eager' (the breakable mode) for this key"
    if inline is None:
        raise UncapturableOpError(
            f"{name}() has no capturable variant, so a full-graph capture (breaks='inline') cannot record "
            f"it: breakgraph cannot tell whether it reads host values a graph would freeze. Give it one "
            f"(@{name}.inline, or @eager_on_graph(inline=True) if it is capturable as it is), or {fix}."
        )
    try:
        return (function if inline is True else inline)(*args, **kwargs)
    except RuntimeError as error:
        named_by_the_watch = isinstance(error, UncapturableOpError)
        if not named_by_the_watch and not is_capture_violation(error):
            raise
        raise UncapturableOpError(f"{name}() cannot be captured inline ({error}); {fix}.") from error


def record_break(
    index: int, name: str, function: Callable, args: tuple, kwargs: dict, result, pool_usage: PoolUsage | None
) -> EagerSegment:
    """The eager segment that replays ``function(*args, **kwargs)``, which returned ``result`` at
    capture: arguments kept as non-owning aliases where they are plain tensors, the result
    where it is only CUDA tensors, and the writer that puts each replay's result where later
    segments read it. With ``pool_usage`` (debug mode: the graph's pool as the break began),
    the arguments' addresses are recorded for the checks at replay."""
    arg_leaves, replay_args, replay_kwargs = _aliased_arguments(args, kwargs)
    if result is None:
        kept, write = None, make_writer(name, None, None)
    elif type(result) is torch.Tensor and result.layout is torch.strided:  # the common case, without taking it apart
        _guard_tensor(name, result, "out", arg_leaves)
        kept = alias_tensor(result) if result.is_cuda else result
        write = make_writer(name, kept, in_arguments=_in_arguments([result], arg_leaves))
    else:
        flat = check_output(name, result, root="out", refreshed_values=True)
        guard_backward(name, flat, arg_leaves)
        kept, kept_flat = alias_result(result, flat)
        write = make_writer(name, kept, kept_flat, in_arguments=_in_arguments(flat.leaves, arg_leaves))
    return EagerSegment(
        index,
        name,
        with_capture_autocast(function),
        replay_args,
        replay_kwargs,
        write,
        result=kept,
        argument_addresses=argument_addresses(function, args, kwargs, pool_usage) if pool_usage is not None else (),
    )


def _aliased_arguments(args: tuple, kwargs: dict) -> tuple[list, tuple, dict]:
    """The arguments' leaves, and the arguments with aliases for their tensors. Arguments that
    are all leaves (tensors, objects) are aliased one by one, without taking them apart."""
    if not args and not kwargs:
        return [], (), {}
    if all(map(trees.is_leaf, args)) and all(map(trees.is_leaf, kwargs.values())):
        replay_args = tuple(alias_leaves(args))
        replay_kwargs = dict(zip(kwargs, alias_leaves(kwargs.values())))
        return [*args, *kwargs.values()], replay_args, replay_kwargs
    leaves, spec = trees.flatten((args, kwargs), objects=False)
    replay_args, replay_kwargs = trees.unflatten(spec, alias_leaves(leaves))
    return leaves, replay_args, replay_kwargs


def _in_arguments(result_leaves: list, argument_leaves: list) -> frozenset[int]:
    """The result's leaves (by index) in an argument's memory: the argument itself, a view of it,
    or an ``out=`` buffer. Later graphs read them where the argument lives."""
    arguments = {_storage(leaf) for leaf in argument_leaves if _has_storage(leaf)} - {0}
    if not arguments:
        return frozenset()
    return frozenset(index for index, leaf in enumerate(result_leaves) if _has_storage(leaf) and _storage(leaf) in arguments)


def _has_storage(leaf) -> bool:
    return is_plain_tensor(leaf) and leaf.layout is torch.strided


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def with_capture_autocast(function: Callable) -> Callable:
    """Replay ``function`` under the CUDA autocast state it was captured under."""
    if not torch.is_autocast_enabled("cuda"):
        return function
    dtype = torch.get_autocast_dtype("cuda")

    def under_autocast(*args, **kwargs):
        with torch.autocast("cuda", dtype=dtype):
            return function(*args, **kwargs)

    return under_autocast


def guard_backward(name: str, result: trees.Flat, argument_leaves: list) -> None:
    """Let a break's result carry autograd history made inside it, and refuse the backward
    that reaches it.

    Inference with grad-requiring parameters needs nothing more. A backward
    through the break would read intermediates saved at capture time, which
    replay does not refresh, so it fails there with the fix. Inputs passed
    straight through are not the break's history.
    """
    for index, leaf in enumerate(result.leaves):
        if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None:
            _guard_tensor(name, leaf, result.path(index, "out"), argument_leaves)


def _guard_tensor(name: str, tensor: torch.Tensor, path: str, argument_leaves: list) -> None:
    if tensor.grad_fn is not None and not any(tensor is leaf for leaf in argument_leaves):
        tensor.register_hook(_refuse_backward(name, path))


def _refuse_backward(name: str, path: str) -> Callable:
    def refuse(_grad):
        raise RuntimeError(
            f"backward reached {name}() -> {path}, the result of an eager break: its backward would "
            "read tensors saved at capture time, which replay does not refresh. Put the break inside a "
            "torch.autograd.Function whose forward and backward each call an @eager_on_graph function "
            "(see docs/training.md)."
        )

    return refuse


def argument_addresses(function: Callable, args: tuple, kwargs: dict, pool_usage: PoolUsage) -> tuple:
    """For every tensor argument: its path, named as the function names it (``x``,
    ``parts['a']``), weak references to it and its storage, its data pointer, and whether
    the graph's pool holds it (``pool_usage``); debug mode checks at replay that none was
    moved or freed."""
    try:
        bound = inspect.signature(function).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        bound = {f"args[{i}]": value for i, value in enumerate(args)} | dict(kwargs)
    return tuple(
        (path, weakref.ref(tensor), StorageWeakRef(tensor.untyped_storage()), tensor.data_ptr(), pool_usage.holds(tensor.data_ptr()))
        for key, value in bound.items()
        for path, tensor in trees.take_apart(value, objects=False).tensors_with_paths(str(key))
    )
