"""Write a break's replay-time result into the buffers its capture-time result occupies.

Graph segments captured after a break read the break's outputs at the
addresses they had during capture. At replay the break runs again and
returns fresh objects; :func:`make_writer` builds the function that checks the
fresh result against the captured one (structure, shapes, dtypes, devices)
and then copies it in place. Everything is checked before anything is
written, so a mismatch leaves the captured buffers untouched.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from breakgraph.base import trees


class WritebackError(RuntimeError):
    """A break returned something at replay that does not fit its capture-time result."""


Writer = Callable[[Any], int]
"""``write(result) -> bytes copied``. A writer's ``result_type`` is the one type a result
may have when the result holds no buffers (None, a number, a string): the writer then only
checks the type and copies nothing, so replay checks it in line. None for the others."""


def make_writer(
    function_name: str,
    captured: Any,
    flat: trees.Flat | None = None,
    *,
    replace_values: bool = True,
    in_arguments: frozenset[int] = frozenset(),
) -> Writer:
    """Return ``write(result) -> bytes copied`` for a break whose capture-time result is
    ``captured`` (``flat``: it taken apart with the objects policy, if the caller has it).
    With ``replace_values`` False only tensors are written, and other values stay the
    captured ones, as a graph's replay leaves them (``graphed``'s eager fallback).
    ``in_arguments``: the leaves (their indices; 0 for a tensor returned whole) that were
    in an argument's memory at capture, which a new tensor at replay may not overwrite."""
    if captured is None:
        return _none_writer(function_name)
    if type(captured) is torch.Tensor:
        return _TensorWriter(function_name, captured, 0 in in_arguments)
    flat = flat or trees.take_apart(captured, objects=True)
    if flat.spec.is_leaf() and not isinstance(captured, torch.Tensor):
        return _ValueWriter(function_name, captured)
    return _TreeWriter(function_name, captured, flat, replace_values, in_arguments)


def _same_storage(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """``src`` already is ``dst`` (same bytes, same layout): nothing to copy."""
    return src.data_ptr() == dst.data_ptr() and src.stride() == dst.stride()


def _tensor_mismatch(dst: torch.Tensor, src: Any) -> str | None:
    if not isinstance(src, torch.Tensor):
        return f"type Tensor at capture, {type(src).__name__} at replay"
    if src.shape != dst.shape:
        return f"shape {tuple(dst.shape)} at capture, {tuple(src.shape)} at replay"
    if src.dtype != dst.dtype:
        return f"dtype {dst.dtype} at capture, {src.dtype} at replay"
    if src.device != dst.device:
        return f"device {dst.device} at capture, {src.device} at replay"
    return None


def _fail(function_name: str, path: str, problem: str):
    raise WritebackError(f"{function_name}() -> {path}: {problem}")


def _fail_over_an_argument(function_name: str, path: str):
    _fail(
        function_name,
        path,
        "an argument's memory at capture (the argument itself or a view of it), where the graphs after the "
        "break read the result; a new tensor at replay, and copying it there would overwrite that argument. "
        "Return the same kind every time: the argument, written in place, or a new tensor (x.clone() where "
        "you return x)",
    )


class _NoneWriter:
    __slots__ = ("function_name",)
    result_type = type(None)

    def __init__(self, function_name: str):
        self.function_name = function_name

    def __call__(self, result) -> int:
        if result is not None:
            _fail(self.function_name, "out", f"None at capture, {type(result).__name__} at replay")
        return 0


@functools.lru_cache(maxsize=1024)
def _none_writer(function_name: str) -> _NoneWriter:
    """One writer per name for results that are None, the most common (it holds nothing else):
    a capture with many such breaks keeps fewer objects for the cycle collector to walk."""
    return _NoneWriter(function_name)


class _TensorWriter:
    """The common case, kept to a handful of attribute reads: it runs once per break per replay."""

    __slots__ = ("function_name", "captured", "nbytes", "in_argument")
    result_type = None

    def __init__(self, function_name: str, captured: torch.Tensor, in_argument: bool):
        self.function_name = function_name
        self.captured = captured
        self.nbytes = captured.numel() * captured.element_size()
        self.in_argument = in_argument

    def __call__(self, result) -> int:
        captured = self.captured
        if result is captured:
            return 0
        problem = _tensor_mismatch(captured, result)
        if problem is not None:
            _fail(self.function_name, "out", problem)
        if _same_storage(captured, result):
            return 0
        if self.in_argument:
            _fail_over_an_argument(self.function_name, "out")
        captured.copy_(result)  # replay runs under no_grad: no autograd bookkeeping here
        return self.nbytes


class _ValueWriter:
    """A number, string or other value returned whole: nothing holds it to write into."""

    __slots__ = ("function_name", "result_type")

    def __init__(self, function_name: str, captured: Any):
        self.function_name = function_name
        self.result_type = type(captured)

    def __call__(self, result) -> int:
        if type(result) is not self.result_type:
            _fail(self.function_name, "out", f"type {self.result_type.__name__} at capture, {type(result).__name__} at replay")
        return 0


class _TreeWriter:
    """Tuples, lists, dicts, dataclasses and objects, nested to any depth.

    Tensors are copied into the captured tensors; other values replace the
    captured ones where their container can take them (lists, dicts,
    attributes; not tuples), if ``replace_values``.
    """

    __slots__ = ("function_name", "captured", "flat", "replace_values", "in_arguments")
    result_type = None

    def __init__(self, function_name: str, captured: Any, flat: trees.Flat, replace_values: bool, in_arguments: frozenset[int]):
        self.function_name = function_name
        self.captured = captured
        self.flat = flat
        self.replace_values = replace_values
        self.in_arguments = in_arguments

    def __call__(self, result) -> int:
        flat = self.flat
        leaves, spec = trees.flatten(result, objects=True)
        if spec != flat.spec:
            where, problem = trees.first_difference(self.captured, result, "out", objects=True)
            _fail(self.function_name, where, problem)
        copies, replacements = [], []
        for index, (old, new) in enumerate(zip(flat.leaves, leaves)):
            if isinstance(old, torch.Tensor):
                problem = _tensor_mismatch(old, new)
                if problem is not None:
                    _fail(self.function_name, flat.path(index, "out"), problem)
                if new is not old and not _same_storage(old, new):
                    if index in self.in_arguments:
                        _fail_over_an_argument(self.function_name, flat.path(index, "out"))
                    copies.append((old, new))
            elif isinstance(new, torch.Tensor) and self.replace_values:  # the graphs after the break read no tensor there
                _fail(self.function_name, flat.path(index, "out"), f"{type(old).__name__} at capture, Tensor at replay")
            elif new is not old and self.replace_values:
                replacements.append((index, new))
        written = 0
        with torch.no_grad():
            for dst, src in copies:
                dst.copy_(src)
                written += dst.numel() * dst.element_size()
        for index, new in replacements:
            if flat.assign(self.captured, index, new):
                flat.leaves[index] = new
        return written
