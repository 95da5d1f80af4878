"""Non-owning aliases of the tensors a break was called with.

A break is replayed with the same addresses it saw at capture, but holding
its arguments would pin their memory. An alias views the same bytes (same
storage pointer, offset, shape and strides) without owning them, as
``torch.cuda.graph``'s trees do for their outputs.
"""

from __future__ import annotations

import copy

import torch


def alias_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor over ``tensor``'s bytes that does not keep them alive.

    Tensor subclasses (and parameters' autograd identity) are not preserved:
    the alias is a plain tensor with no autograd history.
    """
    storage = tensor.untyped_storage()
    unowned = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), tensor.device, storage.nbytes())
    alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return alias.set_(unowned, tensor.storage_offset(), tensor.shape, tensor.stride())


def alias_tree(value):
    """Replace every tensor inside lists, tuples (named too) and dicts by its alias.

    Other objects are kept by reference: engines mutate metadata objects in
    place between steps, and the break must see those updates at replay.
    """
    if isinstance(value, torch.Tensor):
        if type(value) not in (torch.Tensor, torch.nn.Parameter):
            return value
        return alias_tensor(value)
    if isinstance(value, list):
        return [alias_tree(item) for item in value]
    if isinstance(value, tuple):
        items = [alias_tree(item) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        aliased = copy.copy(value)
        for key, item in value.items():
            aliased[key] = alias_tree(item)
        return aliased
    return value


def alias_result(result):
    """What a break keeps of its capture-time result: aliases, when it is only CUDA tensors.

    A CUDA tensor, or lists/tuples/dicts of them (and None), is replaced by
    its aliases, so the break pins no memory: once the model drops the
    result, later segments may reuse its bytes (they stay in the graph's
    pool), as inside one monolithic graph, and replay still writes each fresh
    result there before its reader runs. Anything else (CPU tensors, objects,
    dataclasses, numbers) is kept as is: host memory is not pooled, and
    writeback replaces non-tensor values in the very objects the model holds.
    """
    return alias_tree(result) if _only_cuda_tensors(result) else result


def _only_cuda_tensors(value) -> bool:
    if value is None:
        return True
    if type(value) is torch.Tensor:
        return value.is_cuda
    if isinstance(value, (list, tuple)):
        return all(_only_cuda_tensors(item) for item in value)
    if isinstance(value, dict):
        return all(_only_cuda_tensors(item) for item in value.values())
    return False


def tensor_leaves(value, path: str):
    """Yield ``(path, tensor)`` for every tensor inside lists, tuples and dicts."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from tensor_leaves(item, f"{path}[{index}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from tensor_leaves(item, f"{path}[{key!r}]")
