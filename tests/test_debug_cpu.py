"""Table formatting for the segment summary and the profile (no GPU needed)."""

from breakgraph.debug import format_profile, format_table


def test_table_columns_are_aligned():
    rows = [{"index": 0, "kind": "graph", "name": "graph start -> attention()", "nodes": 12}, {"index": 1, "kind": "eager", "name": "attention", "nodes": ""}]
    text = format_table(rows, ["index", "kind", "name", "nodes"])
    lines = text.splitlines()
    assert lines[0].split() == ["index", "kind", "name", "nodes"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert lines[2].index("graph start") == lines[0].index("name") == lines[3].index("attention")
    assert lines[2].rstrip().endswith("12")


def test_profile_table_has_timing_columns():
    rows = [{"index": 0, "kind": "graph", "name": "g", "mean_us": 1.5, "p50_us": 1.4, "p99_us": 2.0, "share": 1.0}]
    header = format_profile(rows).splitlines()[0].split()
    assert header == ["index", "kind", "name", "mean_us", "p50_us", "p99_us", "share"]
