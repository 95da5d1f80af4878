"""Write a break's replay-time result into the buffers its capture-time result occupies.

Graph segments captured after a break read the break's outputs at the
addresses they had during capture. At replay the break runs again and
returns fresh objects; :func:`make_writer` builds the function that checks the
fresh result against the captured one (structure, shapes, dtypes, devices)
and then copies it in place. Everything is checked before anything is
written, so a mismatch leaves the captured buffers untouched.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch


class WritebackError(RuntimeError):
    """A break returned something at replay that does not fit its capture-time result."""


Writer = Callable[[Any], int]


def make_writer(function_name: str, captured: Any) -> Writer:
    """Return ``write(result) -> bytes copied`` for a break whose capture-time result is ``captured``."""
    if captured is None:
        return _NoneWriter(function_name)
    if type(captured) is torch.Tensor:
        return _TensorWriter(function_name, captured)
    return _TreeWriter(function_name, captured)


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


class _NoneWriter:
    __slots__ = ("function_name",)

    def __init__(self, function_name: str):
        self.function_name = function_name

    def __call__(self, result) -> int:
        if result is not None:
            _fail(self.function_name, "out", f"None at capture, {type(result).__name__} at replay")
        return 0


class _TensorWriter:
    """The common case, kept to a handful of attribute reads: it runs once per break per replay."""

    __slots__ = ("function_name", "captured", "nbytes")

    def __init__(self, function_name: str, captured: torch.Tensor):
        self.function_name = function_name
        self.captured = captured
        self.nbytes = captured.numel() * captured.element_size()

    def __call__(self, result) -> int:
        captured = self.captured
        if result is captured:
            return 0
        problem = _tensor_mismatch(captured, result)
        if problem is not None:
            _fail(self.function_name, "out", problem)
        if _same_storage(captured, result):
            return 0
        captured.copy_(result)  # replay runs under no_grad: no autograd bookkeeping here
        return self.nbytes


class _TreeWriter:
    """Tuples, lists, dicts, dataclasses and objects, nested to any depth."""

    __slots__ = ("function_name", "captured")

    def __init__(self, function_name: str, captured: Any):
        self.function_name = function_name
        self.captured = captured

    def __call__(self, result) -> int:
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        replacements: list[tuple[Callable[[Any], None], Any]] = []
        self._match(self.captured, result, "out", copies, replacements)
        written = 0
        with torch.no_grad():
            for dst, src in copies:
                dst.copy_(src)
                written += dst.numel() * dst.element_size()
        for assign, value in replacements:
            assign(value)
        return written

    def _match(self, captured, result, path, copies, replacements) -> None:
        """Collect the copies and field replacements that make ``captured`` hold ``result``."""
        if isinstance(captured, torch.Tensor):
            problem = _tensor_mismatch(captured, result)
            if problem is not None:
                _fail(self.function_name, path, problem)
            if result is not captured and not _same_storage(captured, result):
                copies.append((captured, result))
            return
        if type(result) is not type(captured):
            _fail(
                self.function_name,
                path,
                f"type {type(captured).__name__} at capture, {type(result).__name__} at replay",
            )
        if isinstance(captured, (list, tuple)):
            if len(result) != len(captured):
                _fail(self.function_name, path, f"length {len(captured)} at capture, {len(result)} at replay")
            # A tuple cannot take new non-tensor values; a list can.
            setter = captured.__setitem__ if isinstance(captured, list) else None
            for index, (old, new) in enumerate(zip(captured, result)):
                self._match_child(old, new, f"{path}[{index}]", setter, index, copies, replacements)
        elif isinstance(captured, dict):
            if result.keys() != captured.keys():
                _fail(
                    self.function_name,
                    path,
                    f"keys {sorted(map(repr, captured))} at capture, {sorted(map(repr, result))} at replay",
                )
            for key, old in captured.items():
                self._match_child(old, result[key], f"{path}[{key!r}]", captured.__setitem__, key, copies, replacements)
        elif _has_fields(captured):
            old_fields, new_fields = _fields(captured), _fields(result)
            if old_fields.keys() != new_fields.keys():
                _fail(
                    self.function_name,
                    path,
                    f"attributes {sorted(old_fields)} at capture, {sorted(new_fields)} at replay",
                )
            setter = _attribute_setter(captured)
            for name, old in old_fields.items():
                self._match_child(old, new_fields[name], f"{path}.{name}", setter, name, copies, replacements)
        # Scalars, strings and None at the root: nothing to write into.

    def _match_child(self, old, new, path, setter, key, copies, replacements) -> None:
        if isinstance(old, torch.Tensor) or _is_structure(old):
            self._match(old, new, path, copies, replacements)
        elif setter is not None and (new is not old):
            replacements.append((lambda value, key=key: setter(key, value), new))


def _is_structure(value) -> bool:
    return isinstance(value, (list, tuple, dict)) or _has_fields(value)


def _has_fields(value) -> bool:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return True
    return hasattr(value, "__dict__") and not isinstance(value, (type, torch.nn.Module)) and not callable(value)


def _fields(value) -> dict[str, Any]:
    if dataclasses.is_dataclass(value):
        return {field.name: getattr(value, field.name) for field in dataclasses.fields(value)}
    return dict(vars(value))


def _attribute_setter(value):
    """setattr that also works on frozen dataclasses (the capture-time object is ours to update)."""
    return lambda name, new: object.__setattr__(value, name, new)
