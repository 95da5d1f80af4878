"""The memory estimate's arithmetic: probe sizes, least-squares lines, extrapolation."""

import math

import pytest
from hypothesis import given, strategies as st

import breakgraph as bg
from breakgraph.base.estimate import SEGMENT_BYTES, Probe, extrapolate, line, probe_sizes

sizes_lists = st.lists(st.integers(1, 4096), min_size=1, max_size=60, unique=True)


@given(sizes_lists, st.integers(2, 8))
def test_probes_are_the_largest_the_smallest_and_sizes_between_largest_first(sizes, count):
    probes = probe_sizes(sizes, count)
    assert probes == sorted(probes, reverse=True) and len(set(probes)) == len(probes)
    assert set(probes) <= set(sizes) and len(probes) <= count
    assert probes[0] == max(sizes) and probes[-1] == min(sizes)
    assert len(probes) == min(count, len(sizes))


@given(st.floats(-1e6, 1e6), st.floats(-1e3, 1e3), st.lists(st.integers(1, 512), min_size=2, max_size=8, unique=True))
def test_a_line_through_points_on_a_line_is_that_line(intercept, slope, xs):
    fitted = line([(x, intercept + slope * x) for x in xs])
    for x in (1, 100, 1000):
        assert fitted(x) == pytest.approx(intercept + slope * x, rel=1e-6, abs=1e-3)


def test_a_line_through_one_point_or_none_is_flat():
    assert line([(4, 10.0)])(100) == 10.0 and line([])(7) == 0.0 and line([(3, 1.0), (3, 5.0)])(9) == 3.0


@given(
    st.integers(0, 2**20),  # bytes each size keeps regardless of its size
    st.integers(0, 2**12),  # bytes it keeps per row
    st.integers(0, 2**22),  # executable bytes per size
    st.integers(0, 2**30),  # pool after the probes
)
def test_exactly_linear_costs_extrapolate_exactly(base, per_row, executable, pool_after):
    sizes = bg.default_capture_sizes(256)
    probed = probe_sizes(sizes)
    probes = [Probe(size, base + per_row * size, executable) for size in probed]
    estimate = extrapolate({None: sizes}, {None: probes}, pool_after, seconds=0.5)
    rest = [size for size in sizes if size not in probed]
    kept = sum(base + per_row * size for size in rest)
    assert estimate.pool_bytes == pool_after + math.ceil(kept / SEGMENT_BYTES) * SEGMENT_BYTES
    assert estimate.executable_bytes == pytest.approx(executable * len(sizes), abs=len(sizes))
    assert estimate.total_bytes == estimate.pool_bytes + estimate.executable_bytes
    assert estimate.probed_sizes == tuple(sorted(probed)) and estimate.seconds == 0.5


def test_the_first_probe_s_kept_bytes_do_not_set_the_line_and_keys_add_up():
    # The largest probe keeps the activations every size reuses: far above the line.
    probes = [Probe(64, 10 * 2**20, 100), Probe(32, 32 * 1024, 100), Probe(1, 1024, 100)]
    sizes = [1, 2, 4, 8, 16, 32, 64]
    one = extrapolate({"a": sizes}, {"a": probes}, 12 * 2**20)
    two = extrapolate({"a": sizes, "b": sizes}, {"a": probes, "b": probes}, 12 * 2**20)
    assert one.pool_bytes == 12 * 2**20 + SEGMENT_BYTES  # four sizes of at most 33 KiB each: one segment
    assert two.executable_bytes == 2 * one.executable_bytes == 2 * 700
