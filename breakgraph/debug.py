"""Seeing inside a breakable graph: checked replay, the segment table, DOT files, per-segment timing."""

from __future__ import annotations

import shutil
import statistics
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import bindings

if TYPE_CHECKING:
    from breakgraph.capture import BreakableCUDAGraph


class SegmentError(RuntimeError):
    """A segment failed during a debug-mode replay; the message names which one."""


def _describe(graph: "BreakableCUDAGraph", index: int) -> str:
    segment = graph.segments[index]
    return f"segment {index} ({segment.kind}: {segment.name})"


def replay_checked(graph: "BreakableCUDAGraph") -> None:
    """Replay one segment at a time, synchronizing after each.

    Checks that every break's argument tensors still sit at their capture-time
    addresses, optionally that break outputs are finite, and turns a CUDA
    error into a :class:`SegmentError` naming the segment that raised it.
    """
    stream = torch.cuda.current_stream(graph._device_index)
    with torch.no_grad():
        for index, segment in enumerate(graph.segments):
            try:
                if segment.kind == "graph":
                    segment.executable.launch(stream)
                else:
                    _check_addresses(segment)
                    segment.replay()
                bindings.synchronize(stream)
            except bindings.CudaError as error:
                raise SegmentError(f"{_describe(graph, index)} failed: {error}") from error
            except RuntimeError as error:
                if "CUDA error" in str(error):
                    raise SegmentError(f"{_describe(graph, index)} failed: {error}") from error
                raise
            if graph.check_finite and segment.kind == "eager":
                _check_finite(graph, index, segment)


def _check_addresses(segment) -> None:
    for path, ref, address in segment.argument_addresses:
        tensor = ref()
        if tensor is not None and tensor.data_ptr() != address:
            raise SegmentError(
                f"{segment.name}() argument {path}: address {address:#x} at capture, "
                f"{tensor.data_ptr():#x} at replay. The graph still reads the old address; "
                "copy new values into the captured tensor (x.copy_(new)) instead of rebinding it"
            )


def _check_finite(graph, index: int, segment) -> None:
    from breakgraph.aliasing import tensor_leaves

    for path, tensor in tensor_leaves(segment.result, "out"):
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise SegmentError(f"{_describe(graph, index)}: {segment.name}() -> {path} has NaN or Inf values")


# -- the segment table ---------------------------------------------------------------


def summary_rows(graph: "BreakableCUDAGraph") -> list[dict]:
    return [
        {
            "index": segment.index,
            "kind": segment.kind,
            "name": segment.name,
            "nodes": segment.num_nodes if segment.kind == "graph" else "",
            "side_streams": ", ".join(f"{sid:#x}" for sid in segment.side_streams),
            "bytes_written": segment.bytes_written if segment.kind == "eager" else "",
        }
        for segment in graph.segments
    ]


def format_table(rows: list[dict], columns: list[str]) -> str:
    """Plain-text table with a header and a rule; columns sized to their contents."""
    cells = [[str(column) for column in columns]] + [[str(row.get(column, "")) for column in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def summary(graph: "BreakableCUDAGraph", print_table: bool = True) -> str:
    rows = summary_rows(graph)
    table = format_table(rows, ["index", "kind", "name", "nodes", "side_streams", "bytes_written"])
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


def to_dot(graph: "BreakableCUDAGraph", directory, render: bool = True) -> list[Path]:
    """Write ``segment_<i>.dot`` per graph segment (CUDA's own DOT export) and
    ``overview.dot`` for the chain of segments and breaks.

    With ``render`` and Graphviz's ``dot`` on the PATH, each file is also
    rendered to SVG. Returns the paths written.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    overview = ["digraph breakgraph {", "  rankdir=LR;"]
    for segment in graph.segments:
        if segment.kind == "graph":
            path = directory / f"segment_{segment.index}.dot"
            segment.graph.to_dot(path)
            written.append(path)
            label = f"graph {segment.index}\\n{segment.num_nodes} nodes"
            overview.append(f'  s{segment.index} [shape=box, label="{label}"];')
        else:
            label = f"eager {segment.index}\\n{segment.name}()".replace('"', "'")
            overview.append(f'  s{segment.index} [shape=ellipse, label="{label}"];')
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


def profile(graph: "BreakableCUDAGraph", iters: int = 20, warmup: int = 3) -> list[dict]:
    """Time every segment with CUDA events around it, over ``iters`` replays.

    Returns one row per segment with mean, p50 and p99 in microseconds and its
    share of the total. Eager breaks are timed on the GPU too: their time
    includes the GPU idling while the host runs the break.
    """
    segments = graph.segments
    stream = torch.cuda.current_stream(graph._device_index)
    samples = [[] for _ in segments]
    events = [torch.cuda.Event(enable_timing=True) for _ in range(len(segments) + 1)]
    with torch.no_grad():
        for iteration in range(warmup + iters):
            events[0].record(stream)
            for index, segment in enumerate(segments):
                if segment.kind == "graph":
                    segment.executable.launch(stream)
                else:
                    segment.replay()
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


def plot_profile(rows: list[dict], path) -> Path:
    """Bar chart of mean time per segment (matplotlib, an optional dependency)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise RuntimeError("plot_profile needs matplotlib: pip install 'breakgraph[plot]'") from error
    path = Path(path)
    colors = ["tab:blue" if row["kind"] == "graph" else "tab:orange" for row in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(rows)), 4))
    ax.bar([str(row["index"]) for row in rows], [row["mean_us"] for row in rows], color=colors)
    ax.set_xlabel("segment (blue: graph, orange: eager break)")
    ax.set_ylabel("mean GPU time per replay (µs)")
    ax.set_title("breakgraph: time per segment")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
