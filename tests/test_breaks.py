"""Recording a break on CPU tensors: what its replay is called with, whichever way the arguments
are taken apart (one by one when every argument is a leaf, as a tree otherwise)."""

import dataclasses

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from breakgraph.base import trees
from breakgraph.recording.breaks import record_break


@dataclasses.dataclass
class Metadata:  # an engine's metadata object: kept by reference, never walked
    lengths: list


class Tagged(torch.Tensor):  # a tensor subclass: carries more than its bytes, kept by reference
    pass


def _tensor(seed: int) -> torch.Tensor:
    base = torch.arange(24.0).reshape(4, 6) + seed
    return base[1:, ::2] if seed % 2 else base  # views keep their offset and strides


leaves = st.one_of(
    st.integers(0, 9).map(_tensor),
    st.integers(0, 9).map(lambda seed: torch.nn.Parameter(_tensor(seed))),
    st.integers(0, 9).map(lambda seed: _tensor(seed).as_subclass(Tagged)),
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


def _check_replay_arguments(args: tuple, kwargs: dict, segment) -> None:
    assert type(segment.args) is tuple and list(segment.kwargs) == list(kwargs)
    for original, replayed in _pairs((args, kwargs), (segment.args, segment.kwargs)):
        if type(original) in (torch.Tensor, torch.nn.Parameter):  # plain tensors: a non-owning alias
            assert type(replayed) is torch.Tensor and replayed is not original
            assert replayed.untyped_storage().data_ptr() == original.untyped_storage().data_ptr()
            assert (replayed.shape, replayed.stride(), replayed.storage_offset()) == (
                original.shape, original.stride(), original.storage_offset()
            )
            assert torch.equal(replayed, original)
        else:  # objects, numbers, None, tensor subclasses: by reference
            assert replayed is original


@settings(max_examples=150, deadline=None)
@given(st.lists(values, max_size=4), st.dictionaries(st.sampled_from(["x", "y", "meta"]), values, max_size=2))
def test_replay_arguments_alias_every_plain_tensor_and_keep_everything_else(args, kwargs):
    segment = record_break(0, "attention", lambda *a, **k: None, tuple(args), kwargs, None, None)
    _check_replay_arguments(tuple(args), kwargs, segment)


def _refuse_to_take_apart(*_args, **_kwargs):
    raise AssertionError("arguments that are all leaves were taken apart as a tree")


@settings(max_examples=50, deadline=None)
@given(st.lists(leaves, max_size=4), st.dictionaries(st.sampled_from(["z", "a", "meta"]), leaves, max_size=3))
def test_arguments_that_are_all_leaves_are_aliased_without_taking_them_apart(args, kwargs):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trees, "flatten", _refuse_to_take_apart)
        segment = record_break(0, "attention", lambda *a, **k: None, tuple(args), kwargs, None, None)
    _check_replay_arguments(tuple(args), kwargs, segment)


def test_a_tensor_result_that_carries_history_refuses_the_backward_and_an_argument_passed_through_does_not():
    weight = torch.ones(3, requires_grad=True)
    made = weight * 2
    record_break(0, "scale", lambda w: w * 2, (weight,), {}, made, None)
    with pytest.raises(RuntimeError, match=r"backward reached scale\(\) -> out"):
        made.sum().backward()
    passed = torch.ones(3, requires_grad=True) * 1
    record_break(0, "identity", lambda x: x, (passed,), {}, passed, None)
    passed.sum().backward()  # the break's input, not its history: nothing to refuse
    by_keyword = torch.ones(3, requires_grad=True) * 1
    record_break(0, "identity", lambda x: x, (), {"x": by_keyword}, by_keyword, None)
    by_keyword.sum().backward()


def test_a_nested_result_refuses_the_backward_at_the_path_of_what_the_break_made():
    weight = torch.ones(3, requires_grad=True)
    passed = torch.ones(3, requires_grad=True) * 1
    made = weight * 3
    record_break(0, "attend", lambda w, p: {"k": (p, w * 3)}, (weight, passed), {}, {"k": (passed, made)}, None)
    passed.sum().backward()  # an argument handed back inside the result: not the break's history
    with pytest.raises(RuntimeError, match=r"backward reached attend\(\) -> out\['k'\]\[1\]"):
        made.sum().backward()
