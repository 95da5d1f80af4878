"""The tree walker: both policies, paths, in-place assignment, structure differences, isolation."""

import collections
import dataclasses
import warnings

import pytest
import torch
import torch.utils._pytree as torch_pytree
from hypothesis import given, settings
from hypothesis import strategies as st

from breakgraph.base import trees


@dataclasses.dataclass
class Pair:
    first: object
    second: object


@dataclasses.dataclass(frozen=True)
class Frozen:
    value: object


class Bag:
    def __init__(self, item, note):
        self.item = item
        self.note = note


leaves = st.one_of(st.integers(-3, 3), st.none(), st.text(max_size=2), st.builds(lambda n: torch.arange(float(n)), st.integers(1, 3)))


def nodes(children):
    return st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.sampled_from("abc"), children, max_size=3),
        st.builds(Pair, children, children),
        st.builds(Frozen, children),
        st.builds(Bag, children, st.integers()),
    )


values = st.recursive(leaves, nodes, max_leaves=10)


def reference_paths(value, path="out"):
    """Every leaf's path, written by hand the way errors print them."""
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from reference_paths(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key in sorted(value):
            yield from reference_paths(value[key], f"{path}[{key!r}]")
    elif isinstance(value, (Pair, Frozen, Bag)):
        for name in (f.name for f in dataclasses.fields(value)) if dataclasses.is_dataclass(value) else vars(value):
            yield from reference_paths(getattr(value, name), f"{path}.{name}")
    else:
        yield path


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (Pair, Frozen, Bag)):
        return same(vars(a), vars(b))
    return a == b


@settings(max_examples=200, deadline=None)
@given(values)
def test_objects_policy_reaches_every_leaf_by_its_path_and_rebuilds(value):
    flat = trees.take_apart(value, objects=True)
    assert [flat.path(i, "out") for i in range(len(flat.leaves))] == list(reference_paths(value))
    assert same(flat.rebuild(flat.leaves), value)


@settings(max_examples=100, deadline=None)
@given(values)
def test_containers_policy_keeps_objects_whole(value):
    leaves, spec = trees.flatten(value, objects=False)
    assert not any(isinstance(leaf, (list, tuple, dict)) for leaf in leaves)
    assert same(trees.unflatten(spec, leaves), value)
    objects = [leaf for leaf in leaves if isinstance(leaf, (Pair, Frozen, Bag))]
    for obj in objects:  # the very objects, by reference
        assert any(obj is leaf for leaf in leaves)


def test_registering_a_dataclass_here_does_not_change_torch_pytree():
    value = Pair(torch.zeros(1), 2)
    trees.take_apart(value, objects=True)
    assert torch_pytree.tree_flatten(value)[0] == [value]


def test_assign_puts_values_where_their_container_can_take_them():
    value = {"l": [1, 2], "t": (3,), "p": Pair(4, 5), "f": Frozen(6), "b": Bag(7, 8)}
    flat = trees.take_apart(value, objects=True)
    by_path = {flat.path(i, "out"): i for i in range(len(flat.leaves))}
    assert flat.assign(value, by_path["out['l'][1]"], 20) and value["l"] == [1, 20]
    assert flat.assign(value, by_path["out['p'].second"], 50) and value["p"].second == 50
    assert flat.assign(value, by_path["out['f'].value"], 60) and value["f"].value == 60
    assert flat.assign(value, by_path["out['b'].note"], 80) and value["b"].note == 80
    assert not flat.assign(value, by_path["out['t'][0]"], 30) and value["t"] == (3,)
    assert not trees.take_apart(5, objects=True).assign(5, 0, 6)


@pytest.mark.parametrize(
    "captured, replayed, where, problem",
    [
        ({"k": [1]}, {"k": [1, 2]}, "out['k']", "length 1 at capture, 2 at replay"),
        ({"a": 1}, {"b": 1}, "out", "keys [\"'a'\"] at capture, [\"'b'\"] at replay"),
        ((1,), [1], "out", "type tuple at capture, list at replay"),
        (Pair([1], 2), Pair([1, 2], 2), "out.first", "length 1 at capture, 2 at replay"),
        (Bag(1, 2), Pair(1, 2), "out", "type Bag at capture, Pair at replay"),
        ([torch.zeros(1)], [[torch.zeros(1)]], "out[0]", "type Tensor at capture, list at replay"),
    ],
)
def test_first_difference_names_the_place_and_the_change(captured, replayed, where, problem):
    assert trees.first_difference(captured, replayed, "out", objects=True) == (where, problem)


def test_map_tensors_rebuilds_containers_only():
    bag = Bag(torch.ones(1), 1)
    mapped = trees.map_tensors(lambda t: t * 2, [torch.ones(2), {"b": bag}, 3])
    assert torch.equal(mapped[0], torch.full((2,), 2.0)) and mapped[1]["b"] is bag and mapped[2] == 3


class Labelled(collections.namedtuple("Point", "x y")):  # a named tuple's subclass, with a __dict__ (as PackedSequence)
    pass


@dataclasses.dataclass
class Output(dict):  # a dataclass that is a dict too, as transformers' ModelOutput: its fields are its items
    logits: object = None

    def __post_init__(self):
        self["logits"] = self.logits


def test_named_tuple_subclasses_and_dict_dataclasses_keep_their_tensors_when_rebuilt():
    value = [Labelled(torch.ones(2), torch.zeros(3)), Output(logits=torch.arange(4.0))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # optree warns where a named tuple's subclass is registered as an object
        flat = trees.take_apart(value, objects=True)
        rebuilt = trees.map_tensors(lambda tensor: tensor + 1, value, objects=True)
    assert [flat.path(index, "out") for index in range(len(flat.leaves))] == ["out[0].x", "out[0].y", "out[1].logits"]
    assert type(rebuilt[0]) is Labelled and torch.equal(rebuilt[0].y, torch.ones(3))
    assert type(rebuilt[1]) is Output and torch.equal(rebuilt[1]["logits"], torch.arange(4.0) + 1)


def test_a_plain_object_is_the_same_structure_whatever_order_its_attributes_were_set_in():
    first, second = Bag(torch.ones(1), 1), Bag.__new__(Bag)
    second.note, second.item = 2, torch.zeros(1)  # set the other way round
    assert trees.flatten(first, objects=True)[1] == trees.flatten(second, objects=True)[1]
