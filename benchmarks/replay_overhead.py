"""Replay overhead per segment: N tiny-kernel segments with no-op breaks between them.

Variants, all in one run: eager; one monolithic torch.cuda.graph (no breaks);
one torch.cuda.CUDAGraph per segment replayed in a Python loop (how vLLM and
SGLang replay); Meta's library (breakable_cuda_graphs, the ``bench`` extra:
one ``breakable_graph`` capture, ``force_no_graph()`` as the break, skipped
with the reason printed where it is not installed); a bare cudaGraphLaunch
loop over cuda.bindings executables (the floor, no break calls); breakgraph
replay().

    python benchmarks/replay_overhead.py [--quick] [--out results]
"""

from __future__ import annotations

import torch

import breakgraph_bindings as bindings
import breakgraph as bg
from breakgraph.base.runtime import run_on_stream
from benchmarks.common import benchmark_parser, device_meta, noop, plot_grouped_bars, replay_each, require_gpu, time_variants, write_outputs
from benchmarks.peers import META, capture_meta_region, load_meta, meta_ratios


def step(x):
    x.add_(1)


def build_variants(n: int, x: torch.Tensor, meta_library):
    stream = torch.cuda.Stream()
    run_on_stream(stream, lambda: step(x))  # warm up
    torch.cuda.synchronize()

    def eager():
        for _ in range(n):
            step(x)
            noop()

    mono = torch.cuda.CUDAGraph()
    with torch.cuda.graph(mono):
        for _ in range(n):
            step(x)

    per_segment = []
    pool = torch.cuda.graph_pool_handle()
    for _ in range(n):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            step(x)
        per_segment.append(g)

    execs = []
    with torch.cuda.stream(stream):
        for _ in range(n):
            bindings.begin_capture(stream)
            step(x)
            execs.append(bindings.end_capture(stream).instantiate())
    torch.cuda.synchronize()
    handles = [e.handle for e in execs]
    launch = bindings.launch_function()

    def floor():
        s = bindings.stream_handle(torch.cuda.current_stream())
        for h in handles:
            launch(h, s)

    graph = bg.BreakableCUDAGraph()
    with bg.BreakableCUDAGraphCapture(graph):
        for _ in range(n):
            step(x)
            noop()
    assert graph.num_graphs == n and graph.num_eager_breaks == n
    variants = {
        "eager": eager,
        "torch monolithic graph": mono.replay,
        "torch CUDAGraph per segment": replay_each(per_segment, noop),
        "bare cudaGraphLaunch loop": floor,
        "breakgraph replay": graph.replay,
    }
    kept = [mono, per_segment, execs, graph]
    if meta_library is not None:
        meta_graph = capture_meta_region(meta_library, n, lambda: step(x))
        variants[META] = meta_graph.replay
        kept.append(meta_graph)
    return variants, kept


def check(variants, n, x):
    for name, run in variants.items():
        x.zero_()
        run()
        torch.cuda.synchronize()
        assert torch.all(x == n), f"{name}: wrong result {x[0].item()} != {n}"


def main(argv=None) -> int:
    parser = benchmark_parser("replay_overhead", __doc__)
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    args = parser.parse_args(argv)
    require_gpu("replay_overhead")
    sizes = [8, 64] if args.quick else [8, 64, 256]
    iters = 20 if args.quick else 200
    meta_library = load_meta()
    rows = []
    for n in sizes:
        x = torch.zeros(256, device="cuda")
        variants, keep = build_variants(n, x, meta_library)
        check(variants, n, x)
        us = {name: value / n for name, value in time_variants(variants, iters).items()}
        floor, ours, torch_seg = us["bare cudaGraphLaunch loop"], us["breakgraph replay"], us["torch CUDAGraph per segment"]
        for name, value in us.items():
            rows.append({"segments": n, "variant": name, "us_per_segment": round(value, 3)})
        ratios = f"breakgraph/floor {ours / floor:.2f}x; torch-per-segment/breakgraph {torch_seg / ours:.2f}x"
        ratios += meta_ratios(us, {"breakgraph": ours})
        rows.append({"segments": n, "variant": "ratios", "us_per_segment": ratios})
        del keep
    write_outputs("replay_overhead", rows, ["segments", "variant", "us_per_segment"], args.out, device_meta(), draw)
    return 0


def draw(ax, rows):
    plot_grouped_bars(ax, rows, "segments", "us_per_segment", lambda n: f"{n} segments")
    ax.set_ylabel("µs per segment (lower is better)")
    ax.set_title(f"Replay overhead per segment ({torch.cuda.get_device_name()})")


if __name__ == "__main__":
    raise SystemExit(main())
