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
from breakgraph.recording.writeback import WritebackError


@dataclasses.dataclass
class Metadata:  # an engine's metadata object: kept by reference, never walked
    lengths: list


class Tagged(torch.Tensor):  # a tensor subclass: carries more than its bytes, kept by reference
    pass


def _tensor(seed: int, device: str) -> torch.Tensor:
    base = torch.arange(24.0, device=device).reshape(4, 6) + seed
    return base[1:, ::2] if seed % 2 else base  # views keep their offset and strides


def argument_strategies(*devices: str):
    """Break arguments: single leaves (tensors on ``devices``, views, parameters, a subclass,
    numbers, None, a metadata object), and those nested in lists and dicts."""
    tensors = st.builds(_tensor, st.integers(0, 9), st.sampled_from(devices))
    leaves = st.one_of(
        tensors,
        tensors.map(torch.nn.Parameter),
        tensors.map(lambda tensor: tensor.as_subclass(Tagged)),
        st.none(),
        st.integers(-3, 3),
        st.builds(Metadata, st.lists(st.integers(0, 9), max_size=2)),
    )
    nested = st.recursive(leaves, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from("ab"), inner), max_leaves=6)
    return leaves, nested


leaves, values = argument_strategies("cpu")


def _pairs(original, replayed):
    leaves, spec = optree.tree_flatten(original, none_is_leaf=True)
    replayed_leaves, replayed_spec = optree.tree_flatten(replayed, none_is_leaf=True)
    assert spec == replayed_spec
    return zip(leaves, replayed_leaves)


def check_replay_arguments(args: tuple, kwargs: dict, segment) -> None:
    assert type(segment.args) is tuple and list(segment.kwargs) == list(kwargs)
    for original, replayed in _pairs((args, kwargs), (segment.args, segment.kwargs)):
        if type(original) in (torch.Tensor, torch.nn.Parameter) and original.is_cuda:  # a non-owning alias
            assert type(replayed) is torch.Tensor and replayed is not original
            assert replayed.untyped_storage().data_ptr() == original.untyped_storage().data_ptr()
            assert (replayed.shape, replayed.stride(), replayed.storage_offset()) == (
                original.shape, original.stride(), original.storage_offset()
            )
            assert torch.equal(replayed, original)
        else:  # host tensors, objects, numbers, None, tensor subclasses: by reference
            assert replayed is original


@settings(max_examples=150, deadline=None)
@given(st.lists(values, max_size=4), st.dictionaries(st.sampled_from(["x", "y", "meta"]), values, max_size=2))
def test_replay_arguments_alias_every_plain_tensor_and_keep_everything_else(args, kwargs):
    segment = record_break(0, "attention", lambda *a, **k: None, tuple(args), kwargs, None, None)
    check_replay_arguments(tuple(args), kwargs, segment)


def _refuse_to_take_apart(*_args, **_kwargs):
    raise AssertionError("arguments that are all leaves were taken apart as a tree")


@settings(max_examples=50, deadline=None)
@given(st.lists(leaves, max_size=4), st.dictionaries(st.sampled_from(["z", "a", "meta"]), leaves, max_size=3))
def test_arguments_that_are_all_leaves_are_aliased_without_taking_them_apart(args, kwargs):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trees, "flatten", _refuse_to_take_apart)
        segment = record_break(0, "attention", lambda *a, **k: None, tuple(args), kwargs, None, None)
    check_replay_arguments(tuple(args), kwargs, segment)


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


def test_a_new_tensor_at_replay_where_the_capture_returned_an_argument_is_refused_before_anything_is_written():
    x = torch.tensor([5.0, 0.3])
    clip = record_break(0, "clip", lambda t: t, (x,), {}, x, None)  # small at capture: the argument itself
    with pytest.raises(WritebackError, match=r"clip\(\) -> out: an argument's memory at capture .*x\.clone\(\)"):
        clip.write(x.clamp(-1, 1))  # large at replay: a new tensor, which would overwrite x
    assert torch.equal(x, torch.tensor([5.0, 0.3]))
    assert clip.write(x) == 0 and clip.write(x[:]) == 0  # the argument again: already where it is read
    made = record_break(0, "clip", lambda t: t, (x,), {}, x.clamp(-1, 1), None)  # a new tensor at capture
    assert made.write(x) == 2 * 4  # the argument at replay: copied into the result's own buffer


def test_in_a_nested_result_only_the_leaves_in_an_argument_are_held_to_it():
    a, b = torch.ones(2), torch.zeros(2)
    swap = record_break(0, "swap", lambda p, q: (p, q), (a, b), {}, {"kv": (a, b[1:]), "new": a * 3}, None)
    with pytest.raises(WritebackError, match=r"swap\(\) -> out\['kv'\]\[0\]: an argument's memory at capture"):
        swap.write({"kv": (b.clone(), b[1:]), "new": a * 4})
    assert torch.equal(a, torch.ones(2))
    assert swap.write({"kv": (a, b[1:]), "new": a * 4}) == 2 * 4  # only the new tensor is copied


def test_a_tensor_at_replay_where_the_capture_had_none_or_a_number_is_refused():
    out = torch.zeros(2)
    for captured in ((out, None), [out, 3], {"out": out, "lse": None}):
        attention = record_break(0, "attention", lambda: None, (), {}, captured, None)
        replayed = type(captured)(torch.ones(2) for _ in range(2)) if not isinstance(captured, dict) else {"out": out, "lse": torch.ones(2)}
        with pytest.raises(WritebackError, match=r"attention\(\) -> out.*: (NoneType|int) at capture, Tensor at replay"):
            attention.write(replayed)


def test_a_sparse_tensor_returned_whole_is_refused_as_in_a_structure():
    sparse = torch.eye(3).to_sparse()
    for result in (sparse, [sparse]):
        with pytest.raises(TypeError, match=r"sparse\(\) returned a tensor of layout torch.sparse_coo at out.*\.to_dense\(\)"):
            record_break(0, "sparse", lambda: result, (), {}, result, None)
