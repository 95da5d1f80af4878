"""Capture sizes and dispatch: which sizes to capture, which one serves a live batch."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from breakgraph.base.sizes import choose_size, default_capture_sizes, validate_capture_sizes

sorted_sizes = st.lists(st.integers(1, 512), min_size=1, max_size=40, unique=True).map(sorted)


@settings(max_examples=300, deadline=None)
@given(sorted_sizes, st.integers(1, 600))
def test_chosen_size_is_the_smallest_that_fits_or_none(sizes, n):
    chosen = choose_size(sizes, n)
    fitting = [s for s in sizes if s >= n]
    if fitting:
        assert chosen == min(fitting)
    else:
        assert chosen is None and n > sizes[-1]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 1024))
def test_default_sizes_follow_the_engines_habit(max_size):
    sizes = default_capture_sizes(max_size)
    assert validate_capture_sizes(sizes, max_size) == sizes
    assert sizes[-1] == max_size and sizes[0] == 1
    assert all(s in (1, 2, 4, 8) or s % 8 == 0 or s == max_size for s in sizes)
    assert all(choose_size(sizes, n) is not None for n in range(1, max_size + 1))


@pytest.mark.parametrize(
    "sizes, error",
    [
        ([], "empty"),
        ([0, 1], "positive"),
        ([1, 1], "twice"),
        ([4, 2], "sorted"),
        ([1, 99], "exceeds"),
        ([1.5], "ints"),
    ],
)
def test_invalid_sizes_are_rejected(sizes, error):
    with pytest.raises((ValueError, TypeError), match=error):
        validate_capture_sizes(sizes, 64)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(-50, 600), min_size=1, max_size=10))
def test_validation_accepts_exactly_strictly_increasing_positive_lists(sizes):
    valid = all(0 < s <= 512 for s in sizes) and all(a < b for a, b in zip(sizes, sizes[1:]))
    if valid:
        assert validate_capture_sizes(sizes, 512) == sizes
    else:
        with pytest.raises(ValueError):
            validate_capture_sizes(sizes, 512)


@pytest.mark.parametrize(
    "max_size, error, words",
    [(0, ValueError, "at least 1"), (-5, ValueError, "at least 1"), ("8", TypeError, "whole number"), (True, TypeError, "whole number"), (8.0, TypeError, "whole number")],
)
def test_default_sizes_of_a_wrong_maximum_say_what_is_needed(max_size, error, words):
    with pytest.raises(error, match=f"max_size must be .*{words}"):
        default_capture_sizes(max_size)
