"""Plain-text tables (no GPU needed)."""

from breakgraph.base.tables import format_table


def test_table_columns_are_aligned():
    rows = [{"index": 0, "kind": "graph", "name": "graph start -> attention()", "nodes": 12}, {"index": 1, "kind": "eager", "name": "attention", "nodes": ""}]
    text = format_table(rows, ["index", "kind", "name", "nodes"])
    lines = text.splitlines()
    assert lines[0].split() == ["index", "kind", "name", "nodes"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert lines[2].index("graph start") == lines[0].index("name") == lines[3].index("attention")
    assert lines[2].rstrip().endswith("12")

