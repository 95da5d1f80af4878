"""Diagnostics that need no GPU: the profile table."""

from breakgraph.diagnostics import format_profile


def test_profile_table_has_timing_columns():
    rows = [{"index": 0, "kind": "graph", "name": "g", "mean_us": 1.5, "p50_us": 1.4, "p99_us": 2.0, "share": 1.0}]
    header = format_profile(rows).splitlines()[0].split()
    assert header == ["index", "kind", "name", "mean_us", "p50_us", "p99_us", "share"]
