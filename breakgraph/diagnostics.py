"""Seeing inside a captured graph: the segment table, DOT files, per-segment timing.

Clients of :class:`~breakgraph.BreakableCUDAGraph`'s public surface
(``segments``, ``device``), each segment describing itself, and of the replay
plan's per-step functions, which the profile times: nothing here is needed to
capture or replay.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
from pathlib import Path
from typing import Protocol

import torch

from breakgraph.graphs.graph import BreakableCUDAGraph
from breakgraph.graphs.plan import ReplayPlan
from breakgraph.base.checks import require_count
from breakgraph.base.tables import format_table


class HoldsGraph(Protocol):
    """A graphed callable (``bg.graphed(...)``), seen through its ``graph``: None where it runs eagerly."""

    graph: BreakableCUDAGraph | None


def captured_graph(graph: "BreakableCUDAGraph | HoldsGraph", what: str) -> BreakableCUDAGraph:
    """``graph`` (or a graphed callable's ``.graph``) once it holds a capture; otherwise an
    error that says what ``what`` needs."""
    if not isinstance(graph, BreakableCUDAGraph):
        inner = getattr(graph, "graph", None)
        if not isinstance(inner, BreakableCUDAGraph):
            ran_eagerly = " (this callable runs eagerly: no GPU, or BREAKGRAPH_DISABLE=1)" if hasattr(graph, "graph") else ""
            raise TypeError(
                f"{what} needs a BreakableCUDAGraph or a graphed callable (bg.graphed(...)), got "
                f"{type(graph).__name__}{ran_eagerly}"
            )
        graph = inner
    if not graph.captured:
        raise RuntimeError(f"{what} needs a captured graph: capture it first")
    return graph


def summary_rows(graph) -> list[dict]:
    graph = captured_graph(graph, "summary")
    return [
        {
            "index": segment.index,
            "kind": segment.kind,
            "name": segment.name,
            "side_streams": ", ".join(f"{sid:#x}" for sid in segment.side_streams),
            **segment.table_cells(),
        }
        for segment in graph.segments
    ]


def summary(graph: "BreakableCUDAGraph | HoldsGraph", print_table: bool = True) -> str:
    """A table of ``graph``'s segments: kind, name, nodes, side streams, bytes written back.

    Arguments:
        graph (BreakableCUDAGraph or graphed callable): a captured graph.
        print_table (bool, optional): also print the table. Default: True.
    """
    graph = captured_graph(graph, "summary")
    table = format_table(summary_rows(graph), ["index", "kind", "name", "nodes", "side_streams", "bytes_written"])
    footer = (
        f"{graph.num_graphs} graph segments, {graph.num_eager_breaks} eager breaks, "
        f"{sum(segment.num_nodes for segment in graph.segments)} nodes, "
        f"{graph.bytes_written_per_replay} bytes written back in the last replay"
    )
    text = f"{table}\n{footer}"
    if print_table:
        print(text)
    return text


# -- DOT export ----------------------------------------------------------------------


def to_dot(graph: "BreakableCUDAGraph | HoldsGraph", directory: str | Path, render: bool = True) -> list[Path]:
    """Write ``segment_<i>.dot`` per graph segment (CUDA's own DOT export) and
    ``overview.dot`` for the chain of segments and breaks; return the paths written.

    Arguments:
        graph (BreakableCUDAGraph or graphed callable): a captured graph.
        directory (str or Path): where the files go (made if missing).
        render (bool, optional): also render each file to SVG where Graphviz's
            ``dot`` is on the PATH. Default: True.
    """
    graph = captured_graph(graph, "to_dot")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    overview = ["digraph breakgraph {", "  rankdir=LR;"]
    for segment in graph.segments:
        path = directory / f"segment_{segment.index}.dot"
        if segment.write_dot(path):
            written.append(path)
        overview.append(f"  s{segment.index} [{segment.dot_node()}];")
    overview += [f"  s{a.index} -> s{b.index};" for a, b in zip(graph.segments, graph.segments[1:])]
    overview.append("}")
    overview_path = directory / "overview.dot"
    overview_path.write_text("\n".join(overview) + "\n")
    written.append(overview_path)
    if render:
        dot = shutil.which("dot")
        if dot is None:
            print("breakgraph.to_dot: Graphviz 'dot' is not installed; wrote .dot files only (apt install graphviz to render)")
        else:
            for path in list(written):
                svg = path.with_suffix(".svg")
                subprocess.run([dot, "-Tsvg", str(path), "-o", str(svg)], check=True)
                written.append(svg)
    return written


# -- profiling ----------------------------------------------------------------------


def profile(graph: "BreakableCUDAGraph | HoldsGraph", iters: int = 20, warmup: int = 3) -> list[dict]:
    """Time every segment of ``graph`` with CUDA events around it.

    Returns one row per segment with mean, p50 and p99 in microseconds and its
    share of the total. Eager breaks are timed on the GPU too: their time
    includes the GPU idling while the host runs the break.

    Arguments:
        graph (BreakableCUDAGraph or graphed callable): a captured graph.
        iters (int, optional): timed replays. Default: 20.
        warmup (int, optional): replays before timing. Default: 3.
    """
    require_count("iters", iters)
    require_count("warmup", warmup, least=0)
    graph = captured_graph(graph, "profile")
    segments = graph.segments
    stream = torch.cuda.current_stream(graph.device)
    plan = ReplayPlan(segments)  # lives while its steps run: a traceback through one shows its lines
    steps = plan.step_functions(stream)
    samples = [[] for _ in segments]
    events = [torch.cuda.Event(enable_timing=True) for _ in range(len(segments) + 1)]
    with torch.no_grad(), torch.autocast("cuda", enabled=False):  # as replay runs its Python
        for iteration in range(warmup + iters):
            events[0].record(stream)
            for index, step in enumerate(steps):
                step()
                events[index + 1].record(stream)
            stream.synchronize()
            if iteration >= warmup:
                for index in range(len(segments)):
                    samples[index].append(events[index].elapsed_time(events[index + 1]) * 1000.0)
    total = sum(statistics.fmean(s) for s in samples) or 1.0
    rows = []
    for segment, times in zip(segments, samples):
        ordered = sorted(times)
        rows.append(
            {
                "index": segment.index,
                "kind": segment.kind,
                "name": segment.name,
                "mean_us": round(statistics.fmean(times), 2),
                "p50_us": round(ordered[len(ordered) // 2], 2),
                "p99_us": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 2),
                "share": round(statistics.fmean(times) / total, 4),
            }
        )
    return rows


def format_profile(rows: list[dict]) -> str:
    return format_table(rows, ["index", "kind", "name", "mean_us", "p50_us", "p99_us", "share"])


_KIND_COLORS = {"graph": "tab:blue", "eager": "tab:orange"}  # the plot's bars; another kind's are gray


def plot_profile(rows: list[dict], path) -> Path:
    """Bar chart of mean time per segment (matplotlib, an optional dependency)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise RuntimeError("plot_profile needs matplotlib: pip install 'breakgraph[plot]'") from error
    path = Path(path)
    colors = [_KIND_COLORS.get(row["kind"], "tab:gray") for row in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(rows)), 4))
    ax.bar([str(row["index"]) for row in rows], [row["mean_us"] for row in rows], color=colors)
    ax.set_xlabel("segment (blue: graph, orange: eager break)")
    ax.set_ylabel("mean GPU time per replay (µs)")
    ax.set_title("breakgraph: time per segment")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def runner_row(key, mode: str, size: int, graph: BreakableCUDAGraph, capture_seconds: float, warmed_up: bool,
               first_use_seconds: float | None) -> dict:
    """One captured (key, size) of a GraphRunner, as a row of its report."""
    return {
        "key": "" if key is None else key,
        "mode": mode,
        "size": size,
        "graphs": graph.num_graphs,
        "eager_breaks": graph.num_eager_breaks,
        "executable_kib": "" if graph.executable_bytes is None else round(graph.executable_bytes / 1024, 1),
        "shared_segments": sum(1 for segment in graph.segments if segment.shared is not None),
        "capture_ms": round(capture_seconds * 1000, 2),
        "warmed_up": warmed_up,
        "first_use_ms": "" if first_use_seconds is None else round(first_use_seconds * 1000, 2),
    }


def print_runner_report(report: dict, shared: bool) -> None:
    """Print a GraphRunner's report: a row per captured size, the memory held, the sizes
    served eagerly (``shared``: with a column for executables shared across sizes)."""
    if report["eager_reason"] is not None:
        print(f"GraphRunner: eager ({report['eager_reason']})")
        return
    rows = report["rows"]
    columns = ["key", "mode", "size", "graphs", "eager_breaks", "capture_ms", "warmed_up", "executable_kib"]
    columns += ["shared_segments"] if shared else []
    columns += ["first_use_ms"] if any(row["first_use_ms"] != "" for row in rows) else []
    print(format_table(rows, columns))
    held = report["executable_bytes"]
    executables = (
        f"executables {held / 2**20:.1f} MiB"
        if held is not None
        else "executables not measured (GraphRunner(measure_memory=True) measures them)"
    )
    print(f"{len(rows)} graphs captured, pool holds {report['pool_bytes'] / 2**20:.1f} MiB, {executables}")
    for row in report["failed"]:
        key = "" if row["key"] == "" else f" (key {row['key']!r})"  # "" stands for a runner without keys
        print(f"size {row['size']}{key} is served eagerly: its capture failed: {row['reason']}")
