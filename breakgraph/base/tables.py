"""Plain-text tables, as the runner's report, the diagnostics and the benchmarks print them."""

from __future__ import annotations


def format_table(rows: list[dict], columns: list[str]) -> str:
    """Plain-text table with a header and a rule; columns sized to their contents.

    Arguments:
        rows (list of dict): one dict per row; a missing column prints empty.
        columns (list of str): the columns, in order.
    """
    cells = [[str(column) for column in columns]] + [[str(row.get(column, "")) for column in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
