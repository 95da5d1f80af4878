"""What a captured function may return: one rule, checked once at capture, with a GPU or without.

A replay re-runs GPU work, so of a capture-time output only its tensors can
be refreshed in place; everything else stays the capture's. Where an output
(of ``graphed``, of a runner's step, or of a break inside any capture)
holds a value that a replay would leave behind, the capture says so:

* dense tensors, in tuples, lists, dicts, dataclasses and objects: refreshed;
* None, what a capture fixes anyway (a dtype, a device, a ``torch.Size``),
  and references that cannot go stale (a class, a function, a module, a
  slice): kept, rightly;
* numbers (NumPy's scalars too), strings, bytes and enum members: kept,
  and :class:`FrozenOutputWarning` says so, naming where;
* anything else (a set, a NumPy array, a generator, an object without a
  ``__dict__``, a sparse tensor, ...): refused with a
  :class:`TypeError` naming where it sits, before any replay could return it
  stale.

A break runs again at every replay, and writeback puts its fresh non-tensor
values into the lists, dicts and objects that hold them; only a break's
values that nothing can take (the result itself, a tuple's item) fall under
the rule.
"""

from __future__ import annotations

import enum
import numbers
from typing import Any

import numpy
import torch

from breakgraph.base import runtime, trees


class FrozenOutputWarning(UserWarning):
    """A captured function returned a Python number or string: replays return its capture-time value."""


# Values a replay cannot leave stale: what the capture fixes anyway, and immutable references
# (a slice; classes, functions and modules pass as callables: a transformers cache holds its layers' class).
_FIXED_BY_CAPTURE = (
    type(None), type(Ellipsis), torch.dtype, torch.device, torch.Size, torch.layout, torch.memory_format, slice, range,
)
_FROZEN = (numbers.Number, str, bytes, enum.Enum, numpy.generic)  # NumPy's scalars: np.bool_ is no Number
_SHOWN = 4  # frozen values a warning names, before "and N more"


def check_output(function_name: str, output: Any, *, root: str = "output", refreshed_values: bool = False) -> trees.Flat | None:
    """Refuse, or warn of, what a replay would return stale in ``output`` (the module's rule).

    Arguments:
        function_name (str): the captured function, as errors name it.
        output: its capture-time output.
        root (str): how paths into ``output`` start (``output``, ``out``).
        refreshed_values (bool): ``output`` is a break's result, whose non-tensor values
            writeback replaces wherever a list, dict or object holds them.

    Returns the output taken apart (None for a lone tensor or None), for a caller that needs it.
    """
    if output is None:
        return None
    if type(output) is torch.Tensor:
        _require_strided(function_name, output, root)
        return None
    flat = trees.take_apart(output, objects=True)
    why = _WHY_A_BREAK_STAYS if refreshed_values else _WHY_AN_OUTPUT_STAYS
    frozen = []
    for index, leaf in enumerate(flat.leaves):
        if isinstance(leaf, torch.Tensor):
            _require_strided(function_name, leaf, flat.path(index, root))
            continue
        if isinstance(leaf, _FIXED_BY_CAPTURE) or callable(leaf) or (refreshed_values and flat.can_assign(index)):
            continue
        where, kind = flat.path(index, root), type(leaf).__name__
        if isinstance(leaf, (dict, list)):
            plain = "dict" if isinstance(leaf, dict) else "list"
            raise TypeError(
                f"{function_name}() returned a {kind} at {where}, a subclass of {plain} whose items breakgraph does not "
                f"walk, so a replay cannot refresh the tensors in it: return a plain {plain} ({plain}(value)), a "
                "dataclass or an object with a __dict__."
            )
        if not isinstance(leaf, _FROZEN):
            raise TypeError(
                f"{function_name}() returned an object of type {kind} at {where}, which a replay cannot refresh: {why}. "
                "Return tensors (torch.as_tensor(...) on the device) in tuples, lists, dicts, dataclasses or objects "
                "with a __dict__, or build this value from the output after each replay."
            )
        frozen.append(f"{leaf!r} ({kind}) at {where}")
    if frozen:
        named = ", ".join(frozen[:_SHOWN]) + (f" and {len(frozen) - _SHOWN} more" if len(frozen) > _SHOWN else "")
        runtime.warn_user(
            f"breakgraph: {function_name}() returned {named}; {why}. Return tensors where a value must change.",
            FrozenOutputWarning,
        )
    return flat


def _require_strided(function_name: str, tensor: torch.Tensor, where: str) -> None:
    """Writeback copies into a tensor's own storage, which a sparse or nested tensor does not have."""
    if tensor.layout is not torch.strided:
        raise TypeError(
            f"{function_name}() returned a tensor of layout {tensor.layout} at {where}, which a replay cannot "
            "refresh in place: return a dense tensor (.to_dense()) and build the other layout after each replay."
        )


_WHY_AN_OUTPUT_STAYS = "a replay re-runs GPU work only, so a graph returns the capture-time value at every replay"
_WHY_A_BREAK_STAYS = (
    "a replay runs the break again, but what the capture did with the value (a shape, a branch, an argument) "
    "stays the capture's, and so does the value where the code after the break holds it"
)
