"""The one way breakgraph walks nested values: optree, with two policies.

* **containers** (``objects=False``): lists, tuples (named too), dicts and
  ``None`` are nodes; everything else is a leaf. Break arguments are walked
  this way, so metadata objects are kept by reference and an engine that
  mutates them between steps is seen at replay.
* **objects** (``objects=True``): dataclasses and plain objects with
  attributes are nodes too. Break results are walked this way, so writeback
  can reach a tensor inside ``AttnOut(out=..., lse=...)``.

Object types are registered in breakgraph's own optree namespace the first
time they are met, so registering a user's dataclass never changes how
``torch.utils._pytree`` or any other library sees it. Paths print as
``out['k'][0].lse``, the form every breakgraph error uses.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
from typing import Any, Callable, Iterator

import optree
import torch

NAMESPACE = "breakgraph"

TreeSpec = optree.PyTreeSpec
Accessor = optree.PyTreeAccessor

_registered: set[type] = set()
_register_lock = threading.Lock()


def _is_object_node(value) -> bool:
    if isinstance(value, (torch.Tensor, torch.nn.Module, type, enum.Enum)) or callable(value):
        return False
    if dataclasses.is_dataclass(value):
        return True
    # A dict, list or tuple subclass keeps its contents in its items, not its attributes: walked as
    # an object it would look empty. optree walks named tuples (subclasses too) and the plain
    # containers; other subclasses stay leaves.
    return hasattr(value, "__dict__") and not isinstance(value, (dict, list, tuple))


def _attribute_names(value) -> tuple[str, ...]:
    if dataclasses.is_dataclass(value):
        return tuple(field.name for field in dataclasses.fields(value))
    return tuple(sorted(vars(value)))  # a plain object's attributes, whatever order its code set them in


def _flatten_object(value):
    names = _attribute_names(value)
    return [getattr(value, name) for name in names], names, names


def _unflatten_object(cls: type) -> Callable:
    if issubclass(cls, dict):  # a dataclass that is a dict too (transformers' ModelOutput): its constructor fills both
        return lambda names, children: cls(**dict(zip(names, children)))

    def build(names, children):
        value = cls.__new__(cls)
        for name, child in zip(names, children):
            object.__setattr__(value, name, child)  # frozen dataclasses too
        return value

    return build


def _leaf_or_register(value) -> bool:
    """optree's ``is_leaf`` for the objects policy; registers an object's type on first sight."""
    if isinstance(value, torch.Tensor):
        return True
    cls = type(value)
    if cls not in _registered and _is_object_node(value):
        with _register_lock:
            if cls not in _registered:
                optree.register_pytree_node(
                    cls,
                    _flatten_object,
                    _unflatten_object(cls),
                    path_entry_type=optree.GetAttrEntry,
                    namespace=NAMESPACE,
                )
                _registered.add(cls)
    return False


_CONTAINERS = {"none_is_leaf": True}  # the containers policy's optree options


def _options(objects: bool) -> dict:
    if objects:
        return {"is_leaf": _leaf_or_register, "none_is_leaf": True, "namespace": NAMESPACE}
    return _CONTAINERS


def is_leaf(value: Any) -> bool:
    """Whether the containers policy keeps ``value`` whole (a tensor, an object, None)."""
    return optree.tree_is_leaf(value, **_CONTAINERS)


def flatten(tree: Any, *, objects: bool) -> tuple[list, TreeSpec]:
    """Leaves in a fixed order, and the structure to rebuild or compare them with."""
    return optree.tree_flatten(tree, **_options(objects))


@dataclasses.dataclass(frozen=True)
class Flat:
    """A value taken apart once: its leaves, its structure, and the way to each leaf."""

    leaves: list
    spec: TreeSpec
    accessors: list[Accessor]

    def rebuild(self, leaves) -> Any:
        return optree.tree_unflatten(self.spec, leaves)

    def path(self, index: int, root: str) -> str:
        """Leaf ``index``'s path written from ``root``: ``out['k'][0].lse``."""
        return self.accessors[index].codify(root)

    def tensors_with_paths(self, root: str) -> Iterator[tuple[str, torch.Tensor]]:
        for index, leaf in enumerate(self.leaves):
            if isinstance(leaf, torch.Tensor):
                yield self.path(index, root), leaf

    @property
    def through_objects(self) -> bool:
        """Whether some leaf sits inside a dataclass or object (not only in containers)."""
        return any(isinstance(entry, optree.GetAttrEntry) for accessor in self.accessors for entry in accessor)

    def can_assign(self, index: int) -> bool:
        """Whether :meth:`assign` can put a new value where leaf ``index`` sits: an
        attribute, a list item or a dict value (not the root, nor a tuple item)."""
        accessor = self.accessors[index]
        if len(accessor) == 0:
            return False
        entry = accessor[-1]
        return isinstance(entry, optree.GetAttrEntry) or issubclass(entry.type, (list, dict))

    def assign(self, tree: Any, index: int, value) -> bool:
        """Put ``value`` where leaf ``index`` sits inside ``tree`` (a value of this
        structure); False where nothing can take it (see :meth:`can_assign`)."""
        if not self.can_assign(index):
            return False
        accessor = self.accessors[index]
        parent, entry = accessor[:-1](tree), accessor[-1]
        if isinstance(entry, optree.GetAttrEntry):
            object.__setattr__(parent, entry.name, value)  # frozen dataclasses too
        else:
            parent[entry.entry] = value
        return True


def take_apart(tree: Any, *, objects: bool) -> Flat:
    """:func:`flatten`, keeping how to reach each leaf (for paths in errors and in-place updates)."""
    accessors, leaves, spec = optree.tree_flatten_with_accessor(tree, **_options(objects))
    return Flat(leaves, spec, accessors)


def unflatten(spec: TreeSpec, leaves) -> Any:
    return optree.tree_unflatten(spec, leaves)


def map_tensors(function: Callable[[torch.Tensor], Any], tree: Any, *, objects: bool = False) -> Any:
    """``tree`` rebuilt with ``function`` applied to every tensor leaf."""
    leaves, spec = flatten(tree, objects=objects)
    return unflatten(spec, [function(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves])


def first_difference(captured: Any, replayed: Any, root: str, *, objects: bool) -> tuple[str, str]:
    """Where two values' structures first differ, and how:
    ``("out['k']", "length 1 at capture, 2 at replay")``. For error messages only."""
    return _difference(captured, replayed, root, _options(objects)) or (root, "structure differs")


def _level(value, options: dict):
    """One level of ``value``: (entries, children), or None for a leaf."""
    if isinstance(value, torch.Tensor):
        return None
    try:
        level = optree.tree_flatten_one_level(value, **options)
    except ValueError:  # optree's word for a leaf
        return None
    return level.entries, level.children


def _difference(captured, replayed, where: str, options: dict) -> tuple[str, str] | None:
    old, new = _level(captured, options), _level(replayed, options)
    if old is None and new is None:
        return None
    if old is None or new is None or type(captured) is not type(replayed):
        return where, f"type {type(captured).__name__} at capture, {type(replayed).__name__} at replay"
    (old_entries, old_children), (new_entries, new_children) = old, new
    if old_entries != new_entries:
        if isinstance(captured, (list, tuple)):
            return where, f"length {len(old_entries)} at capture, {len(new_entries)} at replay"
        if isinstance(captured, dict):
            return where, f"keys {sorted(map(repr, old_entries))} at capture, {sorted(map(repr, new_entries))} at replay"
        return where, f"attributes {sorted(old_entries)} at capture, {sorted(new_entries)} at replay"
    attribute = type(captured) in _registered
    for entry, old_child, new_child in zip(old_entries, old_children, new_children):
        step = f".{entry}" if attribute else f"[{entry!r}]"
        found = _difference(old_child, new_child, where + step, options)
        if found is not None:
            return found
    return None
