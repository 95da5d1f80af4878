"""Property tests of writeback on CPU tensors: random nested structures, mismatches, aliasing."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from breakgraph.recording.writeback import WritebackError, make_writer

DTYPES = [torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.bool]


@dataclasses.dataclass
class Record:
    a: object
    b: object
    n: int = 0


class Holder:
    def __init__(self, x, y):
        self.x = x
        self.y = y


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(1, 4), min_size=0, max_size=3))
    base = (torch.rand(*[s + 1 for s in shape]) * 10).to(dtype) if shape else torch.tensor(3.0).to(dtype)
    if shape and draw(st.booleans()):  # a non-contiguous view
        index = tuple(slice(1, None) for _ in shape)
        view = base[index]
        return view.transpose(0, -1) if len(shape) > 1 and draw(st.booleans()) else view
    return base[tuple(slice(0, s) for s in shape)] if shape else base


leaves = st.one_of(tensors(), st.none(), st.integers(-5, 5), st.text(max_size=3))


def structures(children):
    return st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.text(min_size=1, max_size=2), children, max_size=3),
        st.builds(Record, children, children, st.integers(0, 3)),
        st.builds(Holder, children, children),
    )


trees = st.recursive(leaves, structures, max_leaves=8)


def fresh_like(value, rng):
    """Same structure and tensor metadata, new values; non-tensor leaves change too."""
    if isinstance(value, torch.Tensor):
        return (torch.rand(value.shape, generator=rng) * 10).to(value.dtype)
    if isinstance(value, list):
        return [fresh_like(v, rng) for v in value]
    if isinstance(value, tuple):
        return tuple(fresh_like(v, rng) for v in value)
    if isinstance(value, dict):
        return {k: fresh_like(v, rng) for k, v in value.items()}
    if isinstance(value, Record):
        return Record(fresh_like(value.a, rng), fresh_like(value.b, rng), value.n + 1)
    if isinstance(value, Holder):
        return Holder(fresh_like(value.x, rng), fresh_like(value.y, rng))
    if isinstance(value, int):
        return value + 1
    return value


def tensor_paths(value, path="out"):
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from tensor_paths(v, f"{path}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from tensor_paths(v, f"{path}[{k!r}]")
    elif isinstance(value, Record):
        yield from tensor_paths(value.a, f"{path}.a")
        yield from tensor_paths(value.b, f"{path}.b")
    elif isinstance(value, Holder):
        yield from tensor_paths(value.x, f"{path}.x")
        yield from tensor_paths(value.y, f"{path}.y")


@settings(max_examples=150, deadline=None)
@given(trees, st.integers(0, 2**31 - 1))
def test_writeback_copies_every_leaf_into_the_captured_address(captured, seed):
    before = [(path, t.data_ptr()) for path, t in tensor_paths(captured)]
    replayed = fresh_like(captured, torch.Generator().manual_seed(seed))
    written = make_writer("fn", captured)(replayed)
    after = list(tensor_paths(captured))
    assert [(p, t.data_ptr()) for p, t in after] == before  # addresses unchanged
    for (_p, old), (_q, new) in zip(after, tensor_paths(replayed)):
        assert torch.equal(old, new)
    assert written == sum(t.numel() * t.element_size() for _p, t in after)


@settings(max_examples=100, deadline=None)
@given(trees.filter(lambda t: any(True for _ in tensor_paths(t))), st.data())
def test_shape_mismatch_names_the_path_and_writes_nothing(captured, data):
    paths = list(tensor_paths(captured))
    target_path, target = data.draw(st.sampled_from(paths))
    replayed = fresh_like(captured, torch.Generator().manual_seed(0))
    snapshot = [t.clone() for _p, t in paths]

    def grow(value, path="out"):
        if isinstance(value, torch.Tensor):
            return torch.zeros(*value.shape, 2).to(value.dtype) if path == target_path else value
        if isinstance(value, list):
            return [grow(v, f"{path}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return tuple(grow(v, f"{path}[{i}]") for i, v in enumerate(value))
        if isinstance(value, dict):
            return {k: grow(v, f"{path}[{k!r}]") for k, v in value.items()}
        if isinstance(value, Record):
            return Record(grow(value.a, f"{path}.a"), grow(value.b, f"{path}.b"), value.n)
        if isinstance(value, Holder):
            return Holder(grow(value.x, f"{path}.x"), grow(value.y, f"{path}.y"))
        return value

    with pytest.raises(WritebackError) as info:
        make_writer("attention", captured)(grow(replayed))
    assert str(info.value).startswith(f"attention() -> {target_path}: shape {tuple(target.shape)} at capture")
    for (_p, t), old in zip(paths, snapshot):  # checked before anything was copied
        assert torch.equal(t, old)


def test_error_message_format_from_the_spec():
    captured = {"k": [torch.zeros(4, 8)]}
    with pytest.raises(WritebackError, match=r"^attention\(\) -> out\['k'\]\[0\]: shape \(4, 8\) at capture, \(5, 8\) at replay$"):
        make_writer("attention", captured)({"k": [torch.zeros(5, 8)]})


@pytest.mark.parametrize(
    "captured, replayed, words",
    [
        (torch.zeros(2), torch.zeros(2, dtype=torch.int64), "dtype torch.float32 at capture, torch.int64 at replay"),
        ([torch.zeros(2)], [torch.zeros(2), torch.zeros(2)], "out: length 1 at capture, 2 at replay"),
        ({"a": torch.zeros(1)}, {"b": torch.zeros(1)}, "out: keys"),
        ((torch.zeros(1),), [torch.zeros(1)], "out: type tuple at capture, list at replay"),
        (None, torch.zeros(1), "None at capture"),
        (torch.zeros(1), None, "type Tensor at capture, NoneType at replay"),
        (3, "three", "out: type int at capture, str at replay"),
    ],
)
def test_each_kind_of_mismatch(captured, replayed, words):
    with pytest.raises(WritebackError, match="fn\\(\\) -> ") as info:
        make_writer("fn", captured)(replayed)
    assert words in str(info.value)


def test_values_returned_whole_are_checked_and_not_written():
    writer = make_writer("fn", 3)
    assert writer(4) == 0
    with pytest.raises(WritebackError, match="type int at capture, float at replay"):
        writer(4.0)


def test_aliasing_result_is_not_copied():
    out = torch.zeros(4, 4)
    captured = out[:, :2]
    assert make_writer("fn", captured)(out[:, :2]) == 0
    assert make_writer("fn", (captured, 1))((out[:, :2], 2)) == 0
    assert make_writer("fn", captured)(torch.ones(4, 2)) == 4 * 2 * 4
    assert torch.equal(out[:, :2], torch.ones(4, 2))


def test_non_tensor_fields_are_replaced_where_mutable():
    record = Record(torch.zeros(2), "old", 1)
    holder = Holder(torch.zeros(1), 5)
    captured = {"r": record, "h": holder, "l": [1, torch.zeros(1)]}
    make_writer("fn", captured)({"r": Record(torch.ones(2), "new", 2), "h": Holder(torch.ones(1), 6), "l": [9, torch.ones(1)]})
    assert record.b == "new" and record.n == 2 and holder.y == 6 and captured["l"][0] == 9
    assert torch.equal(record.a, torch.ones(2))


def test_frozen_dataclass_fields_are_updated():
    @dataclasses.dataclass(frozen=True)
    class Frozen:
        t: torch.Tensor
        n: int

    captured = Frozen(torch.zeros(3), 1)
    make_writer("fn", captured)(Frozen(torch.ones(3), 2))
    assert captured.n == 2 and torch.equal(captured.t, torch.ones(3))
