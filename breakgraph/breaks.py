"""Recording an eager break: what its replay needs, and nothing that pins memory.

Arguments are kept as non-owning aliases (containers walked, objects kept by
reference), the result as aliases when it is only CUDA tensors, plus the
writer that puts every replay's result where later segments read it. A
result with autograd history made inside the break is refused, and the
autocast state it ran under is kept for replay.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Callable

import torch

from breakgraph import trees
from breakgraph.aliasing import alias_leaves, alias_result
from breakgraph.segments import EagerSegment
from breakgraph.writeback import make_writer


def record_break(
    index: int, name: str, function: Callable, args: tuple, kwargs: dict, result, record_addresses: bool
) -> EagerSegment:
    """The eager segment that replays ``function(*args, **kwargs)``, which returned ``result`` at
    capture: arguments and result kept as non-owning aliases where they are CUDA tensors, and
    the writer that puts each replay's result where later segments read it."""
    has_arguments = bool(args or kwargs)
    arg_leaves, arg_spec = trees.flatten((args, kwargs), objects=False) if has_arguments else ([], None)
    if result is None:
        kept, write = None, make_writer(name, None, None)
    else:
        flat = trees.take_apart(result, objects=True)
        reject_autograd_history(name, flat, arg_leaves)
        kept, kept_flat = alias_result(result, flat)
        write = make_writer(name, kept, kept_flat)
    replay_args, replay_kwargs = trees.unflatten(arg_spec, alias_leaves(arg_leaves)) if has_arguments else ((), {})
    return EagerSegment(
        index,
        name,
        with_capture_autocast(function),
        replay_args,
        replay_kwargs,
        kept,
        write,
        argument_addresses(function, args, kwargs) if record_addresses else (),
    )


def with_capture_autocast(function: Callable) -> Callable:
    """Replay ``function`` under the CUDA autocast state it was captured under."""
    if not torch.is_autocast_enabled("cuda"):
        return function
    dtype = torch.get_autocast_dtype("cuda")

    def under_autocast(*args, **kwargs):
        with torch.autocast("cuda", dtype=dtype):
            return function(*args, **kwargs)

    return under_autocast


def reject_autograd_history(name: str, result: trees.Flat, argument_leaves: list) -> None:
    """Refuse a break whose result carries autograd history made inside it.

    Its backward would read intermediates saved at capture time, which
    replay does not refresh. Inputs passed straight through are fine.
    """
    inputs = None
    for path, tensor in result.tensors_with_paths("out"):
        if tensor.grad_fn is None:
            continue
        if inputs is None:
            inputs = {id(leaf) for leaf in argument_leaves}
        if id(tensor) not in inputs:
            raise RuntimeError(
                f"{name}() -> {path} requires grad: a break's backward would read tensors saved at "
                "capture time, which replay does not refresh. Put the break inside a "
                "torch.autograd.Function whose forward and backward each call an "
                "@eager_on_graph function (see the README, 'Training')."
            )


def argument_addresses(function: Callable, args: tuple, kwargs: dict) -> tuple:
    """(path, weak reference, data pointer) of every tensor argument, named as the
    function names them (``x``, ``parts['a']``), for debug mode's moved-input check."""
    try:
        bound = inspect.signature(function).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        bound = {f"args[{i}]": value for i, value in enumerate(args)} | dict(kwargs)
    return tuple(
        (path, weakref.ref(tensor), tensor.data_ptr())
        for key, value in bound.items()
        for path, tensor in trees.take_apart(value, objects=False).tensors_with_paths(str(key))
    )
