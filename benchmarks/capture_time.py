"""Capture time of a region with N breaks: breakgraph against the torch-per-segment ways.

Variants, side by side in one run: breakgraph (one BreakableCUDAGraphCapture);
one torch.cuda.CUDAGraph per segment through capture_begin/capture_end (vLLM's
way); one torch.cuda.graph(...) context per segment (Meta's way). Each region
is N segments of a tiny kernel with a no-op eager function between them; every
variant's replay is checked against eager first.

    python -m benchmarks.capture_time [--quick] [--out results]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import breakgraph as bg
from benchmarks.common import device_meta, noop, replay_each, write_outputs


def capture_breakgraph(n, x, pool):
    graph = bg.BreakableCUDAGraph(pool=pool)
    with bg.BreakableCUDAGraphCapture(graph):
        for _ in range(n):
            x.add_(1)
            noop()
    return graph.replay


def capture_begin_end(n, x, pool, stream):
    graphs = []
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        for _ in range(n):
            g = torch.cuda.CUDAGraph()
            g.capture_begin(pool=pool)
            x.add_(1)
            g.capture_end()
            noop()
            graphs.append(g)
    return replay_each(graphs, noop)


def graph_context_per_segment(n, x, pool, stream):
    graphs = []
    for _ in range(n):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool, stream=stream):
            x.add_(1)
        noop()
        graphs.append(g)
    return replay_each(graphs, noop)


def timed_capture(make, repeats):
    seconds, replay = [], None
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        replay = make()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds) * 1000, replay


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--out", default="results")
    args = parser.parse_args(argv)
    sizes = [8, 64] if args.quick else [8, 64, 256]
    repeats = 2 if args.quick else 5
    stream = torch.cuda.Stream()
    x = torch.zeros(256, device="cuda")
    x.add_(1)  # warm up
    rows = []
    for n in sizes:
        makers = {
            "breakgraph": lambda: capture_breakgraph(n, x, torch.cuda.MemPool()),
            "capture_begin/capture_end per segment": lambda: capture_begin_end(n, x, torch.cuda.graph_pool_handle(), stream),
            "torch.cuda.graph context per segment": lambda: graph_context_per_segment(n, x, torch.cuda.graph_pool_handle(), stream),
        }
        ms = {}
        for name, make in makers.items():
            ms[name], replay = timed_capture(make, repeats)
            x.zero_()
            replay()
            torch.cuda.synchronize()
            assert torch.all(x == n), f"{name}: replay gave {x[0].item()}, eager gives {n}"
            rows.append({"breaks": n, "variant": name, "capture_ms": round(ms[name], 2)})
        ours = ms["breakgraph"]
        rows.append(
            {
                "breaks": n,
                "variant": "ratios",
                "capture_ms": (
                    f"context-per-segment/breakgraph {ms['torch.cuda.graph context per segment'] / ours:.2f}x; "
                    f"begin-end/breakgraph {ms['capture_begin/capture_end per segment'] / ours:.2f}x"
                ),
            }
        )
    write_outputs("capture_time", rows, ["breaks", "variant", "capture_ms"], args.out, device_meta(), draw)
    return 0


def draw(ax, rows):
    for variant in dict.fromkeys(r["variant"] for r in rows):
        points = [(r["breaks"], r["capture_ms"]) for r in rows if r["variant"] == variant]
        ax.plot(*zip(*points), marker="o", label=variant)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("breaks in the region")
    ax.set_ylabel("capture time (ms, lower is better)")
    ax.set_title(f"Capture time ({torch.cuda.get_device_name()})")


if __name__ == "__main__":
    raise SystemExit(main())
