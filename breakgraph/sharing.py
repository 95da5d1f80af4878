"""Executables shared across graphs of one topology: one per segment instead of one per graph.

A GraphRunner holds one breakable graph per batch size, and each graph
segment its own executable: device memory the driver takes outside torch's
pool, once per segment per size. Graphs of different sizes usually differ
only in kernel parameters (and in which kernel cuBLAS picked), which
``cudaGraphExecUpdate`` can change in place. Sharing keeps one executable per
segment index and updates it to the graph being replayed when that differs
from the last one: memory for speed, paid only when the size changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import breakgraph_bindings as bindings
from breakgraph.graph import BreakableCUDAGraph
from breakgraph.segments import SharedExecutable


@dataclass(frozen=True)
class Refusal:
    """A segment that keeps its own executable: ``graph`` (its position in the list given
    to :func:`share_executables`), the segment's index, and why CUDA refused the update."""

    graph: int
    segment: int
    reason: str


def share_executables(graphs: Sequence[BreakableCUDAGraph]) -> list[Refusal]:
    """Let every graph launch the first graph's executables, segment by segment, where
    ``cudaGraphExecUpdate`` accepts it; destroy the executables no longer needed and
    return the refusals (those segments keep their own). Graphs that share must not
    be replayed concurrently: a shared executable holds one graph's parameters at a time."""
    if not graphs:
        return []
    for graph in graphs:
        if not graph.captured or graph.segments and _released(graph):
            raise RuntimeError("share_executables needs captured graphs with their executables (restore them first)")
    reference = graphs[0]
    shared = {
        segment.index: segment.shared or SharedExecutable(segment.executable, segment.graph)
        for segment in reference.segments
        if segment.kind == "graph"
    }
    refusals = []
    kinds = [segment.kind for segment in reference.segments]
    for position, graph in enumerate(graphs[1:], start=1):
        same_structure = [segment.kind for segment in graph.segments] == kinds
        for segment in graph.segments:
            if segment.kind != "graph" or segment.shared is not None:
                continue
            if not same_structure:
                refusals.append(Refusal(position, segment.index, "different segments and breaks"))
                continue
            holder = reference.segments[segment.index]
            if segment.num_nodes != holder.num_nodes:  # CUDA would refuse it: a different topology
                refusals.append(Refusal(position, segment.index, f"{segment.num_nodes} nodes, not {holder.num_nodes}"))
                continue
            try:
                shared[segment.index].take(segment.graph)
            except bindings.GraphUpdateRefused as refused:
                refusals.append(Refusal(position, segment.index, refused.reason))
            else:
                segment.share(shared[segment.index])
                owner = reference.segments[segment.index]
                owner.shared = shared[segment.index]  # it keeps its executable, and launches through the shared one
    for graph in graphs:
        graph.rebuild_replay_plan()
    return refusals


def _released(graph: BreakableCUDAGraph) -> bool:
    return any(segment.kind == "graph" and segment.executable is None and segment.shared is None for segment in graph.segments)
