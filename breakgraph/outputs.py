"""What a captured function may return: one rule, checked once at capture, with a GPU or without.

A replay re-runs GPU work, so of a capture-time output only its tensors can
be refreshed in place; everything else stays the capture's. Where an output
(of ``graphed``, of a runner's step, or of a break inside any capture)
holds a value that a replay would leave behind, the capture says so:

* tensors, in tuples, lists, dicts, dataclasses and objects: refreshed;
* None, and what a capture fixes anyway (a dtype, a device, a ``torch.Size``):
  kept, rightly;
* Python numbers, strings, bytes and enum members: kept, and
  :class:`FrozenOutputWarning` says so;
* anything else (a set, a NumPy array, a generator, a module, ...): refused
  with a :class:`TypeError` naming where it sits, before any replay could
  return it stale.

A break runs again at every replay, and writeback puts its fresh non-tensor
values into the lists, dicts and objects that hold them; only a break's
values that nothing can take (the result itself, a tuple's item) fall under
the rule.
"""

from __future__ import annotations

import enum
import numbers
from typing import Any

import torch

from breakgraph import runtime, trees


class FrozenOutputWarning(UserWarning):
    """A captured function returned a Python number or string: replays return its capture-time value."""


_FIXED_BY_CAPTURE = (type(None), torch.dtype, torch.device, torch.Size, torch.layout, torch.memory_format)
_FROZEN = (numbers.Number, str, bytes, enum.Enum)


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
    if output is None or type(output) is torch.Tensor:
        return None
    flat = trees.take_apart(output, objects=True)
    warned = False
    for index, leaf in enumerate(flat.leaves):
        if isinstance(leaf, (torch.Tensor, *_FIXED_BY_CAPTURE)) or (refreshed_values and flat.can_assign(index)):
            continue
        where, kind = flat.path(index, root), type(leaf).__name__
        why = _WHY_A_BREAK_STAYS if refreshed_values else _WHY_AN_OUTPUT_STAYS
        if not isinstance(leaf, _FROZEN):
            raise TypeError(
                f"{function_name}() returned a {kind} at {where}, which a replay cannot refresh: {why}. Return tensors "
                "(torch.as_tensor(...) on the device) in tuples, lists, dicts, dataclasses or objects, or build this "
                "value from the output after each replay."
            )
        if not warned:
            runtime.warn_user(
                f"breakgraph: {function_name}() returned the Python {kind} {leaf!r} at {where}; {why}. Return a "
                "tensor where the value must change.",
                FrozenOutputWarning,
            )
            warned = True
    return flat


_WHY_AN_OUTPUT_STAYS = "a replay re-runs GPU work only, so every replay returns this capture-time value"
_WHY_A_BREAK_STAYS = (
    "a replay runs the break again, but what the capture did with this value (a shape, a branch, an argument) "
    "stays the capture's, and so does this value where the code after the break holds it"
)
