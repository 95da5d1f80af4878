"""GraphRunner without a GPU: size validation, dispatch/padding properties, the eager fallback."""

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import breakgraph as bg
from breakgraph.config import cuda_available
from breakgraph.runner import choose_size, default_capture_sizes, validate_capture_sizes

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


def test_keys_select_in_priority_order_without_capturing():
    runner = bg.GraphRunner(
        lambda x, key: x,
        torch.zeros(8, 2),
        capture_sizes={"uniform": [1, 2], "mixed": [4, 8]},
        keys=["uniform", "mixed"],
        key_fn=lambda x: ["uniform", "mixed"],
        progress=False,
    )
    assert runner.select(2, ["uniform", "mixed"]) == ("uniform", 2)
    assert runner.select(3, ["uniform", "mixed"]) == ("mixed", 4)
    assert runner.select(9, ["uniform", "mixed"]) is None
    assert runner.select(1, ["mixed"]) == ("mixed", 4)


def test_runner_argument_errors():
    with pytest.raises(ValueError, match="disagree"):
        bg.GraphRunner(lambda a, b: a, (torch.zeros(4, 2), torch.zeros(5, 2)))
    with pytest.raises(ValueError, match="together"):
        bg.GraphRunner(lambda a: a, torch.zeros(4, 2), keys=["a"])
    with pytest.raises(TypeError, match="batch dimension"):
        bg.GraphRunner(lambda a: a, torch.tensor(3.0))


@pytest.mark.skipif(cuda_available(), reason="checks the no-GPU fallback")
def test_runner_runs_eagerly_without_a_gpu():
    calls = []

    def fn(x, y):
        calls.append(x.shape[0])
        return x * 2 + y

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner = bg.GraphRunner(fn, (torch.zeros(16, 3), torch.zeros(16, 3))).capture()
    assert any("eagerly" in str(w.message) for w in caught)
    x, y = torch.randn(5, 3), torch.randn(5, 3)
    torch.testing.assert_close(runner(x, y), x * 2 + y)
    assert calls == [5]
    with pytest.raises(ValueError, match="does not fit"):
        runner(torch.randn(5, 4), torch.randn(5, 4))
    with pytest.raises(ValueError, match="n = 0"):
        runner(torch.randn(0, 3), torch.randn(0, 3))
    assert runner.report(print_table=False)["eager_reason"]
