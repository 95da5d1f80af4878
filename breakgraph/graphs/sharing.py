"""Executables shared across graphs of one topology: one per segment and topology, not per graph.

A GraphRunner holds one breakable graph per batch size, and each graph
segment its own executable: device memory the driver takes outside torch's
pool, once per segment per size. Graphs of different sizes usually differ
only in kernel parameters (and in which kernel cuBLAS picked), which
``cudaGraphExecUpdate`` can change in place; where cuBLAS adds a kernel (a
split-K reduction) the topology differs, and such segments share among
themselves. Sharing keeps one executable per segment index and topology and
updates it to the graph being replayed when that differs from the last one:
memory for time, paid only when the size changes.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

import breakgraph_bindings as bindings
from breakgraph.graphs.graph import BreakableCUDAGraph
from breakgraph.recording.segments import GraphSegment, SharedExecutable


@dataclass(frozen=True)
class Refusal:
    """A segment that keeps its own executable: ``graph`` (its position in the list given
    to :func:`share_executables`), the segment's index, and why (``reasons``): CUDA's
    update results (each once) where every executable of its topology refused it,
    "different segments and breaks" where its graph's structure differs from the first graph's,
    or "conditional nodes" where it holds ``bg.cond`` or ``bg.while_loop`` nodes (each graph's
    node reads a handle of its own graph, which an update cannot carry over)."""

    graph: int
    segment: int
    reasons: tuple[str, ...]

    @property
    def reason(self) -> str:
        """The reasons as one line."""
        return ", ".join(self.reasons)


def share_executables(graphs: Sequence[BreakableCUDAGraph]) -> list[Refusal]:
    """Let the graphs launch one executable per segment index and topology (node count),
    updated with ``cudaGraphExecUpdate`` to the graph being replayed; destroy the
    executables no longer needed and return the refusals (those segments keep their
    own). Graphs whose segments and breaks differ from the first graph's keep theirs.
    Call it again after capturing more graphs. Graphs that share must not be replayed
    concurrently: a shared executable holds one graph's parameters at a time.

    Arguments:
        graphs (list of BreakableCUDAGraph): captured graphs, their executables in place.
    """
    if isinstance(graphs, BreakableCUDAGraph) or not isinstance(graphs, (list, tuple)):
        raise TypeError(f"share_executables takes a list of BreakableCUDAGraphs, got {type(graphs).__name__}")
    seen: dict[int, int] = {}
    for position, graph in enumerate(graphs):
        if not isinstance(graph, BreakableCUDAGraph):
            raise TypeError(f"share_executables takes a list of BreakableCUDAGraphs; item {position} is a {type(graph).__name__}")
        first = seen.setdefault(id(graph), position)
        if first != position:
            raise ValueError(f"share_executables got the same graph twice (items {first} and {position}): list each graph once")
    for graph in graphs:
        if not graph.captured or graph.released:
            raise RuntimeError("share_executables needs captured graphs with their executables (restore them first)")
    if not graphs:
        return []
    kinds = [segment.kind for segment in graphs[0].segments]
    groups: dict[int, list[tuple[SharedExecutable, GraphSegment]]] = defaultdict(list)
    refusals = []
    for position, graph in enumerate(graphs):
        same_structure = [segment.kind for segment in graph.segments] == kinds
        for segment in graph.segments:
            if not segment.has_own_executable:
                continue  # an eager break, a segment torch replays, or one that launches another's executable already
            if not same_structure:
                refusals.append(Refusal(position, segment.index, ("different segments and breaks",)))
                continue
            if segment.conditional_nodes:
                refusals.append(Refusal(position, segment.index, ("conditional nodes",)))
                continue
            if segment.shared is None and _join(segment, groups[segment.index], refusals, position):
                continue
            groups[segment.index].append((segment.shared or SharedExecutable(segment.executable, segment.graph), segment))
    for graph in graphs:
        graph.rebuild_replay_plan()
    return refusals


def _join(segment: GraphSegment, group: list, refusals: list, position: int) -> bool:
    """Make ``segment`` launch the first executable of ``group`` that takes its graph; if
    every one of its topology refuses, record one refusal (it then keeps its own)."""
    reasons = []
    for shared, owner in group:
        if owner.num_nodes != segment.num_nodes:
            continue  # another topology: CUDA would refuse it
        try:
            shared.take(segment.graph)
        except bindings.GraphUpdateRefused as refused:
            reasons.append(refused.reason)
            continue
        segment.share(shared)
        owner.shared = shared  # it keeps its executable, and launches through the shared one
        return True
    if reasons:
        refusals.append(Refusal(position, segment.index, tuple(dict.fromkeys(reasons))))
    return False
