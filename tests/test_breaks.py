"""Recording a break on CPU tensors: what its replay is called with, whichever way the arguments
are taken apart (one by one when every argument is a leaf, as a tree otherwise)."""

import dataclasses

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from breakgraph.breaks import record_break


@dataclasses.dataclass
class Metadata:  # an engine's metadata object: kept by reference, never walked
    lengths: list


def _tensor(seed: int) -> torch.Tensor:
    base = torch.arange(24.0).reshape(4, 6) + seed
    return base[1:, ::2] if seed % 2 else base  # views keep their offset and strides


leaves = st.one_of(
    st.integers(0, 9).map(_tensor),
    st.none(),
    st.integers(-3, 3),
    st.builds(Metadata, st.lists(st.integers(0, 9), max_size=2)),
)
values = st.recursive(leaves, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from("ab"), inner), max_leaves=6)


def _pairs(original, replayed):
    leaves, spec = optree.tree_flatten(original, none_is_leaf=True)
    replayed_leaves, replayed_spec = optree.tree_flatten(replayed, none_is_leaf=True)
    assert spec == replayed_spec
    return zip(leaves, replayed_leaves)


@settings(max_examples=150, deadline=None)
@given(st.lists(values, max_size=4), st.dictionaries(st.sampled_from(["x", "y", "meta"]), values, max_size=2))
def test_replay_arguments_alias_every_tensor_and_keep_everything_else(args, kwargs):
    segment = record_break(0, "attention", lambda *a, **k: None, tuple(args), kwargs, None, None)
    assert type(segment.args) is tuple and list(segment.kwargs) == list(kwargs)
    for original, replayed in _pairs((tuple(args), kwargs), (segment.args, segment.kwargs)):
        if isinstance(original, torch.Tensor):
            assert replayed is not original and replayed.untyped_storage().data_ptr() == original.untyped_storage().data_ptr()
            assert (replayed.shape, replayed.stride(), replayed.storage_offset()) == (
                original.shape, original.stride(), original.storage_offset()
            )
            assert torch.equal(replayed, original)
        else:
            assert replayed is original


def test_a_tensor_result_that_carries_history_refuses_the_backward_and_an_argument_passed_through_does_not():
    weight = torch.ones(3, requires_grad=True)
    made = weight * 2
    record_break(0, "scale", lambda w: w * 2, (weight,), {}, made, None)
    with pytest.raises(RuntimeError, match=r"backward reached scale\(\) -> out"):
        made.sum().backward()
    passed = torch.ones(3, requires_grad=True) * 1
    record_break(0, "identity", lambda x: x, (passed,), {}, passed, None)
    passed.sum().backward()  # the break's input, not its history: nothing to refuse
