"""Aliases view a break's tensors without owning them; what is not only CUDA tensors is kept as is."""

import dataclasses

import torch

from breakgraph.base import trees
from breakgraph.recording.aliasing import alias_leaves, alias_result, alias_tensor


def test_an_alias_views_the_same_bytes_with_the_same_layout():
    base = torch.arange(24.0).reshape(4, 6)
    view = base[1:, 2:5]
    alias = alias_tensor(view)
    assert alias.data_ptr() == view.data_ptr()
    assert (alias.shape, alias.stride(), alias.storage_offset()) == (view.shape, view.stride(), view.storage_offset())
    base[2, 3] = -1.0
    assert alias[1, 1] == -1.0  # the same bytes, not a copy
    assert type(alias) is torch.Tensor and not alias.requires_grad


def test_an_alias_does_not_keep_its_storage_alive():
    tensor = torch.zeros(8)
    storage = tensor.untyped_storage()._weak_ref()
    alias = alias_tensor(tensor)
    del tensor
    assert torch.UntypedStorage._expired(storage)  # a view would have kept it
    del alias


def test_an_alias_is_conjugated_and_negated_as_its_tensor_is():
    z = torch.tensor([1 + 2j, 3 - 1j])
    for view in (z.conj(), z.conj().imag, z.conj().real):
        alias = alias_tensor(view)
        assert torch.equal(alias, view) and alias.is_conj() == view.is_conj() and alias.is_neg() == view.is_neg()


def test_host_tensors_subclasses_and_objects_are_kept_by_reference():
    class Wrapped(torch.Tensor):
        pass

    host, parameter = torch.ones(2), torch.nn.Parameter(torch.ones(2))  # host memory: a temporary would be freed
    wrapped = torch.ones(2).as_subclass(Wrapped)
    marker = object()
    kept = alias_leaves([host, parameter, wrapped, marker, 3])
    assert all(after is before for after, before in zip(kept, [host, parameter, wrapped, marker, 3]))


def test_a_result_that_is_not_only_cuda_tensors_is_kept_as_it_is():
    @dataclasses.dataclass
    class Out:
        x: torch.Tensor

    for result in ([torch.ones(2), None], {"k": torch.ones(2)}, Out(torch.ones(2)), (torch.ones(2), 3)):
        flat = trees.take_apart(result, objects=True)
        kept, kept_flat = alias_result(result, flat)
        assert kept is result and kept_flat is flat
