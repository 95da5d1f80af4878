"""Meta's library of breakable CUDA graphs, the peer the benchmarks measure breakgraph against.

It is an optional install (the ``bench`` extra), so every benchmark asks
:func:`load_meta` for it: where it is missing, the benchmark prints why,
skips that one variant and still measures the rest.
"""

from __future__ import annotations

from types import ModuleType

META = "Meta breakable_cuda_graphs"  # the variant's name in every benchmark's table
MISSING = "Meta's library breakable-cuda-graphs is not installed: pip install -e '.[bench]'"


def load_meta() -> ModuleType | None:
    """The module ``breakable_cuda_graphs``, or None after printing why its variant is skipped."""
    try:
        import breakable_cuda_graphs
    except ImportError:
        print(f"skipping the variant {META!r}: {MISSING}")
        return None
    return breakable_cuda_graphs


def meta_ratios(measured: dict, ours: dict[str, float], digits: int = 2) -> str:
    """The ratios row's part for Meta's variant: ``; meta/<name> <ratio>x`` for each of
    ``ours`` (breakgraph's figures by name), or nothing where Meta's was not measured."""
    if META not in measured:
        return ""
    return "".join(f"; meta/{name} {measured[META] / value:.{digits}f}x" for name, value in ours.items())


def capture_meta_region(library: ModuleType, n: int, work, stream=None):
    """The micro-benchmarks' region in Meta's library: ``n`` segments of ``work()``, split by
    its empty break ``force_no_graph()``; returns the ``BreakableCUDAGraph``.

    Its capture keeps the empty graph a break at the region's end would leave
    behind (breakgraph drops it), so the breaks sit between the segments:
    ``n`` segments and ``n - 1`` breaks, where the other variants make ``n`` of
    each. One empty graph more would cost Meta a launch; one break fewer
    saves it only the call of an empty function.
    """
    graph = library.BreakableCUDAGraph()
    with library.breakable_graph(graph, stream=stream):
        for i in range(n):
            if i:
                library.force_no_graph()
            work()
    return graph
