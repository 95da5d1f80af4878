"""Batch sizes and graph keys: which a runner captures, and which captured size serves a live batch."""

from __future__ import annotations

import bisect
from typing import Callable, Hashable, Sequence

from breakgraph.base.checks import require_callable


def default_capture_sizes(max_size: int) -> list[int]:
    """The engines' habit: 1, 2, 4, 8, then every multiple of 8 up to ``max_size`` (itself included).

    Arguments:
        max_size (int): the largest batch to capture, at least 1.
    """
    if isinstance(max_size, bool) or not isinstance(max_size, int):
        raise TypeError(f"max_size must be a whole number of rows (the largest batch to capture), got {max_size!r}")
    if max_size < 1:
        raise ValueError(f"max_size must be at least 1 (the largest batch to capture), got {max_size}")
    sizes = [s for s in (1, 2, 4, 8) if s <= max_size] + list(range(16, max_size + 1, 8))
    if max_size not in sizes:
        sizes.append(max_size)
    return sizes


def validate_capture_sizes(sizes: Sequence[int], max_size: int) -> list[int]:
    """Check that ``sizes`` is a strictly increasing list of positive ints no larger than ``max_size``."""
    sizes = list(sizes)
    if not sizes:
        raise ValueError("capture_sizes is empty: give at least one batch size")
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(f"capture_sizes must hold ints, got {size!r}")
        if size <= 0:
            raise ValueError(f"capture_sizes must be positive, got {size}")
        if size > max_size:
            raise ValueError(f"capture size {size} exceeds the static buffers' batch dimension {max_size}")
    for smaller, larger in zip(sizes, sizes[1:]):
        if smaller == larger:
            raise ValueError(f"capture_sizes has {smaller} twice")
        if smaller > larger:
            raise ValueError(f"capture_sizes must be sorted ascending: {smaller} comes before {larger}")
    return sizes


def choose_size(sizes: Sequence[int], n: int) -> int | None:
    """The smallest captured size that holds ``n`` rows, or None above the largest."""
    index = bisect.bisect_left(sizes, n)
    return sizes[index] if index < len(sizes) else None


def checked_keys(keys: Sequence[Hashable] | None, key_fn: Callable | None) -> tuple[list, Callable | None]:
    """The runner's keys ([None] without ``keys``) and its ``key_fn``."""
    if (keys is None) != (key_fn is None):
        raise ValueError("give keys and key_fn together, or neither")
    if keys is None:
        return [None], None
    require_callable("key_fn", key_fn)
    if isinstance(keys, (str, bytes)) or not isinstance(keys, (list, tuple)) or not keys:
        raise TypeError(f"keys must be a non-empty list of the graph variants' keys, got {keys!r}")
    if len(set(keys)) != len(keys):
        raise ValueError(f"keys must be distinct, got {list(keys)}")
    return list(keys), key_fn


def preferred_keys(returned: object, keys: list) -> list:
    """What ``key_fn`` returned, as a list of the runner's ``keys``, most preferred first
    (once each); anything else is refused."""
    chosen = list(dict.fromkeys(returned)) if isinstance(returned, (list, tuple)) else [returned]
    if not chosen or any(key not in keys for key in chosen):
        raise ValueError(f"key_fn returned {chosen!r}, but this runner's keys are {keys}: return one or more of them, most preferred first")
    return chosen


def known_keys(keys: Sequence[Hashable], known: list) -> list:
    """``keys`` as a list, once each is one of ``known`` (the runner's)."""
    return _known_to_runner("keys", keys, known, "keys")


def known_sizes(sizes: Sequence[int], known: Sequence[int]) -> list[int]:
    """``sizes`` as a list, once each is one of ``known`` (the runner's sizes, of any key)."""
    return _known_to_runner("sizes", sizes, sorted(set(known)), "batch sizes", (list, tuple, range))


def _known_to_runner(name: str, values, known: list, what: str, sequences: tuple = (list, tuple)) -> list:
    """``values`` (the argument ``name``) as a list, once each is one of ``known``."""
    if isinstance(values, (str, bytes)) or not isinstance(values, sequences):
        raise TypeError(f"{name} must be a list of this runner's {what}, got {values!r}")
    unknown = [value for value in values if value not in known]
    if unknown:
        raise ValueError(f"{name} {unknown} are not this runner's; its {name} are {known}")
    return list(values)


def sizes_by_key(capture_sizes, keys: list, modes: dict, max_size: int) -> dict[Hashable, list[int]]:
    """Each key's batch sizes, checked: one list for all keys, or a dict with every key."""
    if capture_sizes is None:
        capture_sizes = default_capture_sizes(max_size)
    if not isinstance(capture_sizes, (list, tuple, range, dict)):
        raise TypeError(
            f"capture_sizes must be a list of batch sizes (or a dict of key -> list), got {capture_sizes!r}; "
            f"for one size write [{capture_sizes!r}]"
        )
    if not isinstance(capture_sizes, dict):
        capture_sizes = dict.fromkeys(keys, capture_sizes)
    if set(capture_sizes) != set(keys):
        raise ValueError(f"capture_sizes has keys {list(capture_sizes)}, expected {keys}")
    return {key: validate_capture_sizes(capture_sizes[key], max_size) if modes[key] != "none" else [] for key in keys}


def by_key_and_size(item: tuple) -> tuple[str, int]:
    """Sort key for ``((key, size), value)`` items: by key, as text, then by size."""
    (key, size), _value = item
    return str(key), size
