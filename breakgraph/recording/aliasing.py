"""Non-owning aliases of the tensors a break was called with and returned.

A break is replayed with the same addresses it saw at capture, but holding
its arguments would pin their memory. An alias views the same bytes (same
storage pointer, offset, shape and strides) without owning them, as
``torch.cuda.graph``'s trees do for their outputs. Only CUDA tensors are
aliased: their bytes stay in the graph's pool, where the segments before the
break write them at every replay; host memory is not pooled, so a host
tensor the body made (``torch.tensor(lengths)``) would be freed under its
alias, and is kept by reference instead.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from breakgraph.base import trees


def alias_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor over ``tensor``'s bytes that does not keep them alive.

    The alias is a plain tensor with no autograd history, conjugated or negated
    as ``tensor`` is (``z.conj()`` and ``z.conj().imag`` are such lazy views).
    """
    storage = tensor.untyped_storage()
    unowned = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), tensor.device, storage.nbytes())
    alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    alias = alias.set_(unowned, tensor.storage_offset(), tensor.shape, tensor.stride())
    if tensor.is_conj():
        alias = alias.conj()
    if tensor.is_neg():
        alias = alias._neg_view()
    return alias


def is_plain_tensor(leaf) -> bool:
    """A tensor that is its bytes and nothing more: subclasses (quantized, DTensor, user
    wrappers) carry more, so they are kept, never aliased or told apart by their memory."""
    return type(leaf) in (torch.Tensor, torch.nn.Parameter)


def _aliasable(leaf) -> bool:
    return is_plain_tensor(leaf) and leaf.is_cuda


def alias_leaves(leaves) -> list:
    """``leaves`` with every plain CUDA tensor replaced by its alias; other leaves (metadata
    objects an engine mutates between steps, host tensors) kept by reference."""
    return [alias_tensor(leaf) if _aliasable(leaf) else leaf for leaf in leaves]


def alias_result(result, flat: trees.Flat) -> tuple[Any, trees.Flat]:
    """What a break keeps of its capture-time result (``flat`` is ``result`` taken apart):
    aliases, when it is only CUDA tensors.

    A CUDA tensor, or lists/tuples/dicts of them (and None), is replaced by its
    aliases, so the break pins no memory: once the model drops the result,
    later segments may reuse its bytes (they stay in the graph's pool), as
    inside one monolithic graph, and replay writes each fresh result there
    before its reader runs. Anything else (objects, dataclasses, numbers, CPU
    tensors) is kept as is: host memory is not pooled, and writeback replaces
    non-tensor values in the very objects the model holds. Returns what is
    kept, and it taken apart.
    """
    only_cuda = all(leaf is None or (type(leaf) is torch.Tensor and leaf.is_cuda) for leaf in flat.leaves)
    if not only_cuda or flat.through_objects:
        return result, flat
    aliases = alias_leaves(flat.leaves)
    return flat.rebuild(aliases), dataclasses.replace(flat, leaves=aliases)
