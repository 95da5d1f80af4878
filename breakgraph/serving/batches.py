"""A runner's static input buffers: the views each size is captured on, and live batches
checked, copied in and padded, and outputs cut back to the live rows."""

from __future__ import annotations

import math
from typing import Any

import torch

from breakgraph.base import trees


class StaticInputs:
    """Max-size buffers (a tensor, or a tuple/list/dict of tensors) whose dimension 0 is the batch."""

    def __init__(self, buffers):
        leaves, _spec = trees.flatten(buffers, objects=False)
        if not leaves or not all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in leaves):
            raise TypeError("static_inputs must be a tensor or a tuple/list/dict of tensors with a batch dimension 0")
        self.max_size = leaves[0].shape[0]
        if any(t.shape[0] != self.max_size for t in leaves):
            raise ValueError(f"static inputs disagree on the batch dimension: {[tuple(t.shape) for t in leaves]}")
        self.buffers = buffers
        self.leaves = leaves
        # What every call checks, kept in the form the check compares; the buffers' own order
        # is their leaves' order where they are one tensor or a flat tuple/list of tensors.
        self._flat = isinstance(buffers, torch.Tensor) or (isinstance(buffers, (tuple, list)) and len(buffers) == len(leaves))
        self._fits = [(leaf.shape[1:], leaf.dtype) for leaf in leaves]
        self._spans = [_storage_span(leaf) for leaf in leaves]  # where a live input would overlap a buffer

    @property
    def device(self) -> torch.device:
        return self.leaves[0].device

    def refuse_meta(self) -> None:
        """Refuse buffers on the meta device: they hold no data, with a GPU or without."""
        for index, leaf in enumerate(self.leaves):
            if leaf.is_meta:
                raise ValueError(
                    f"static input {index} is on the meta device, which holds no data: give the runner real "
                    "tensors (CUDA tensors to capture)"
                )

    def require_cuda(self) -> None:
        """Refuse to capture on buffers off the GPU: a graph replays only the CUDA work it captured."""
        for index, leaf in enumerate(self.leaves):
            if not leaf.is_cuda:
                raise ValueError(
                    f"static input {index} is on {leaf.device}, but a graph replays only CUDA work: give the runner "
                    "CUDA tensors (x.cuda()) to capture"
                )

    def arguments(self, inputs, extra: dict) -> tuple[tuple, dict]:
        """How ``fn`` is called on ``inputs`` (shaped like the buffers): a tensor or a
        tuple/list positionally, a dict by keyword, ``extra`` by keyword."""
        if isinstance(inputs, torch.Tensor):
            return (inputs,), extra
        if isinstance(inputs, dict):
            return (), {**inputs, **extra}
        return tuple(inputs), extra

    def views(self, size: int):
        """The buffers' first ``size`` rows, shaped like the buffers."""
        return trees.map_tensors(lambda tensor: tensor[:size], self.buffers)

    def live(self, args: tuple, kwargs: dict):
        """A call's arguments shaped like the buffers."""
        buffers = self.buffers
        if isinstance(buffers, dict):
            if args:
                raise TypeError("this runner's static inputs are a dict: pass live inputs by keyword")
            return kwargs
        if kwargs:
            raise TypeError("pass live inputs positionally, in the order of the static inputs")
        if isinstance(buffers, torch.Tensor):
            if len(args) != 1:
                raise TypeError(f"expected 1 input tensor, got {len(args)}")
            if not isinstance(args[0], torch.Tensor):
                raise TypeError(f"expected a tensor whose dimension 0 is the batch, got {type(args[0]).__name__}")
            return args[0]
        return type(buffers)(*args) if hasattr(buffers, "_fields") else type(buffers)(args)

    def check(self, inputs) -> list[torch.Tensor]:
        """The live input tensors, in the buffers' order, after checking that they fit them.

        A step bound by the host pays for this check at every call, so a batch that fits
        is told by one pass of attribute reads; inputs in a dict or nested containers, and
        inputs that do not fit, go through :meth:`_check_leaf_by_leaf`, which says what is wrong."""
        if self._flat:
            lives = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
            if len(lives) == len(self._fits) and _fit(lives, self._fits):
                return lives
        return self._check_leaf_by_leaf(inputs)

    def _check_leaf_by_leaf(self, inputs) -> list[torch.Tensor]:
        """:meth:`check` taken apart: the live tensors, or the first way they do not fit, in words."""
        statics = self.leaves
        if isinstance(self.buffers, dict) and set(inputs) != set(self.buffers):
            raise ValueError(f"expected inputs {sorted(self.buffers)}, got {sorted(inputs)}")
        lives, _spec = trees.flatten(inputs, objects=False)
        if len(lives) != len(statics):
            raise ValueError(f"expected {len(statics)} inputs, got {len(lives)}")
        for index, live in enumerate(lives):
            if not isinstance(live, torch.Tensor):
                raise TypeError(f"input {index}: expected a tensor, got {type(live).__name__}")
        for index, live in enumerate(lives):
            if live.dim() == 0:
                raise ValueError(f"input {index} is a 0-dim tensor: the runner needs the batch in dimension 0")
        n = lives[0].shape[0]
        if n == 0:
            raise ValueError("empty batch: n = 0 rows; skip the call instead")
        for index, (static, live) in enumerate(zip(statics, lives)):
            if live.shape[0] != n:
                raise ValueError(f"input {index}: {live.shape[0]} rows, but input 0 has {n}")
            if live.shape[1:] != static.shape[1:]:
                raise ValueError(
                    f"input {index}: shape {tuple(live.shape)} does not fit static buffer {tuple(static.shape)} "
                    "(only dimension 0, the batch, may differ)"
                )
            if live.dtype != static.dtype:
                raise ValueError(f"input {index}: dtype {live.dtype}, static buffer has {static.dtype}")
        return lives

    def padded(self, inputs, rows: int, pad_value: float):
        """``inputs`` (shaped like the buffers) with ``pad_value`` rows added up to ``rows``:
        new tensors, for a batch run eagerly at the size every rank runs."""

        def pad(tensor: torch.Tensor) -> torch.Tensor:
            extra = tensor.new_full((rows - tensor.shape[0], *tensor.shape[1:]), pad_value)
            return torch.cat([tensor, extra])

        return trees.map_tensors(pad, inputs)

    def fill(self, live: list[torch.Tensor], size: int, pad_value: float) -> None:
        """Copy ``live`` into the first rows and pad the rest up to ``size``. A live input that is
        the buffer's own first rows (an engine that prepares its inputs in the static buffers
        passes them as they are) is not copied onto itself. Several inputs are copied (and
        zero-padded) by one foreach call each: every launch costs a host-bound step as much."""
        n = live[0].shape[0]
        targets, sources = [], []
        for static, fresh in zip(self.leaves, live):
            if fresh.data_ptr() != static.data_ptr() or fresh.stride() != static.stride():
                targets.append(static[:n])
                sources.append(fresh)
        # One foreach copy where every input is on its buffer's device and lies outside every
        # buffer; otherwise copy_ each, which refuses (or orders) a copy between overlapping memory.
        if len(targets) > 1 and all(
            fresh.device == target.device and not _overlaps(fresh.data_ptr(), self._spans)
            for fresh, target in zip(sources, targets)
        ):
            torch._foreach_copy_(targets, sources)
        else:
            for target, fresh in zip(targets, sources):
                target.copy_(fresh)
        if n < size:
            padding = [static[n:size] for static in self.leaves]
            if len(padding) > 1 and pad_value == 0 and math.copysign(1.0, pad_value) > 0:  # -0.0 is filled as given
                torch._foreach_zero_(padding)
            else:
                for rows in padding:
                    rows.fill_(pad_value)


def _storage_span(tensor: torch.Tensor) -> tuple[int, int]:
    """The addresses ``tensor``'s storage covers (none for a tensor on the meta device)."""
    if tensor.is_meta:
        return 0, 0
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def _overlaps(address: int, spans: list[tuple[int, int]]) -> bool:
    return any(start <= address < end for start, end in spans)


def _fit(lives: list, fits: list) -> bool:
    """Whether every live input is a tensor of the same non-zero rows, trailing shape and dtype
    as its buffer's (``fits``: each buffer's trailing shape and dtype)."""
    n = None
    for live, (trailing, dtype) in zip(lives, fits):
        if not isinstance(live, torch.Tensor):
            return False
        shape = live.shape
        if not shape or shape[1:] != trailing or live.dtype != dtype:
            return False
        if n is None:
            n = shape[0]
        elif shape[0] != n:
            return False
    return n != 0


def live_rows(output: Any, size: int, n: int, clone: bool) -> Any:
    """``output`` with every tensor whose dimension 0 is the captured ``size`` cut to ``n`` rows."""

    def rows(tensor: torch.Tensor) -> torch.Tensor:
        if n < size and tensor.dim() > 0 and tensor.shape[0] == size:
            tensor = tensor[:n]
        return tensor.clone() if clone else tensor

    if type(output) is torch.Tensor:  # the common case, without taking it apart
        return rows(output)
    return trees.map_tensors(rows, output, objects=True)  # dataclasses and objects too, as a capture allows them


