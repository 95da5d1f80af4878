"""Capture time: regions with N breaks, and an engine's start-up at 35 batch sizes.

Part 1, side by side in one run: breakgraph (one BreakableCUDAGraphCapture,
with its default settings, which watch the ops for random ones, and with
``random_ops="error"`` (no watch) and ``random_ops="break"`` (random ops as
breaks)); ``graphed(fn, x, warmup=0)`` (the callable form, which captures
without the watch until it meets a random op);
one torch.cuda.CUDAGraph per segment through capture_begin/capture_end (vLLM's
way); one torch.cuda.graph(...) context per segment (how Meta's library
captures a segment); Meta's library itself (breakable_cuda_graphs, the
``bench`` extra: one ``breakable_graph``, ``force_no_graph()`` as the break);
and the floor, bare cuda.bindings capture and instantiation per segment.
Each region is N segments of a tiny kernel with a no-op eager function
between them.

Part 2, an engine's start-up: the decoder of ``decode_step`` captured at the
35 batch sizes vLLM captures by default up to 256 (1, 2, 4, 8, 16, 24, …,
256) into one shared pool: breakgraph's GraphRunner with its defaults (one
warm-up step, then every size captured directly), the runner with a warm-up
step before every size, the runner measuring its executables' memory
(``measure_memory=True``), one torch.cuda.CUDAGraph per segment per size
after a warm-up step per size (the peers' way), and Meta's library's way:
a warm-up step per size, then one ``BreakableCUDAGraph`` per size, all
sharing one pool. A lazy runner's first-use latency (capture on the first
batch of a size) is reported beside. Where Meta's library is not installed
its variants are skipped with the reason printed.

Every variant's replay is checked against eager first. A capture's time
ends when its graphs are ready to replay; releasing earlier captures, and
freeing the memory their pools cached, is not counted.

    python -m benchmarks.capture_time [--quick] [--out results] [--layers 16]
"""

from __future__ import annotations

import functools
import statistics
import time

import torch

import breakgraph_bindings as bindings
import breakgraph as bg
from benchmarks.common import benchmark_parser, device_meta, noop, plot_lines, replay_each, require_gpu, write_outputs
from benchmarks.decoder import Decoder, DecoderConfig, MetaBreakable
from benchmarks.decoder_sizes import BatchInputs, capture_breakgraph_sizes, capture_piecewise_sizes, check_sizes, graphs_replay, runner_replay
from benchmarks.peers import META, capture_meta_region, load_meta, meta_ratios


def capture_breakgraph(n, x, pool, random_ops="graph"):
    graph = bg.BreakableCUDAGraph(pool=pool)
    with bg.BreakableCUDAGraphCapture(graph, random_ops=random_ops):
        for _ in range(n):
            x.add_(1)
            noop()
    return graph.replay


def capture_graphed(n, x):
    """The callable form: no warm-up, and no random op, so no op watch."""

    def region(t):
        for _ in range(n):
            t.add_(1)
            noop()

    return bg.graphed(region, x, warmup=0).replay


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


def capture_bare(n, x, stream):
    """The floor: cuda.bindings begin/end/instantiate per segment and the no-op
    break between them, with none of breakgraph's bookkeeping."""
    executables = []
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        for _ in range(n):
            bindings.begin_capture(stream)
            x.add_(1)
            graph = bindings.end_capture(stream)
            executables.append((graph, graph.instantiate()))
            noop()

    def replay():
        stream = torch.cuda.current_stream()
        for _graph, executable in executables:
            executable.launch(stream)
            noop()

    return replay


def timed_capture(make, repeats):
    """Median ms of ``make()`` over ``repeats``; every result is kept until the end, so
    no capture pays for releasing an earlier one. Returns the ms and the last result.

    The allocator's cache is emptied first, untimed: torch frees a dead graph pool's
    memory only when the cache is emptied, which ``torch.cuda.graph`` does at every
    capture and breakgraph at a capture's start once one of its pools has died, so the
    variant timed next would otherwise pay ``cudaFree`` for the pools the variant before
    it left (an engine starts with none)."""
    seconds, results = [], []
    for _ in range(repeats):
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        start = time.perf_counter()
        results.append(make())
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds) * 1000, results[-1]


def break_count_rows(sizes, repeats, meta_library) -> list[dict]:
    stream = torch.cuda.Stream()
    x = torch.zeros(256, device="cuda")
    x.add_(1)  # warm up
    makers = {
        "breakgraph": lambda n: capture_breakgraph(n, x, None),
        "breakgraph, random_ops='error'": lambda n: capture_breakgraph(n, x, None, random_ops="error"),
        "breakgraph, random_ops='break'": lambda n: capture_breakgraph(n, x, None, random_ops="break"),
        "breakgraph graphed(fn, warmup=0)": lambda n: capture_graphed(n, x),
        "capture_begin/capture_end per segment": lambda n: capture_begin_end(n, x, torch.cuda.graph_pool_handle(), stream),
        "torch.cuda.graph context per segment": lambda n: graph_context_per_segment(n, x, torch.cuda.graph_pool_handle(), stream),
        "bare cuda.bindings capture per segment (floor)": lambda n: capture_bare(n, x, stream),
    }
    if meta_library is not None:
        makers[META] = lambda n: capture_meta_region(meta_library, n, lambda: x.add_(1), stream).replay
    for make in makers.values():  # first-use costs, on no variant's account
        timed_capture(lambda: make(8), 2)
    rows = []
    for n in sizes:
        samples = {name: [] for name in makers}
        for _ in range(repeats):  # interleaved, so the machine's drift falls on every variant alike
            for name, make in makers.items():
                elapsed, replay = timed_capture(lambda: make(n), 1)
                samples[name].append(elapsed)
                x.zero_()
                replay()
                torch.cuda.synchronize()
                assert torch.all(x == n), f"{name}: replay gave {x[0].item()}, eager gives {n}"
        ms = {name: statistics.median(values) for name, values in samples.items()}
        rows += [{"breaks": n, "variant": name, "capture_ms": round(value, 2)} for name, value in ms.items()]
        context, begin_end = ms["torch.cuda.graph context per segment"], ms["capture_begin/capture_end per segment"]
        floor = ms["bare cuda.bindings capture per segment (floor)"]
        for name in ("breakgraph", "breakgraph, random_ops='error'", "breakgraph, random_ops='break'", "breakgraph graphed(fn, warmup=0)"):
            ratios = (
                f"{name}: context-per-segment/it {context / ms[name]:.2f}x; "
                f"begin-end/it {begin_end / ms[name]:.2f}x; it/floor {ms[name] / floor:.2f}x"
            )
            ratios += meta_ratios(ms, {"it": ms[name]})
            rows.append({"breaks": n, "variant": "ratios", "capture_ms": ratios})
    return rows


def startup_rows(config: DecoderConfig, sizes, repeats, meta_library) -> list[dict]:
    """Engine start-up: the decoder at every size, breakgraph's runner against the peers' way."""
    decoder = Decoder(config, max_batch=max(sizes))
    inputs = BatchInputs(decoder, max(sizes), length=1015)
    stream = torch.cuda.Stream()
    inputs.warm_up(sizes, stream)
    checked = sorted({sizes[0], sizes[len(sizes) // 2], sizes[-1]})
    makers = {
        "breakgraph GraphRunner": lambda: capture_breakgraph_sizes(inputs, sizes),
        "breakgraph GraphRunner, warm-up before every size": lambda: capture_breakgraph_sizes(inputs, sizes, warmup=1),
        "breakgraph GraphRunner, measure_memory=True": lambda: capture_breakgraph_sizes(inputs, sizes, measure_memory=True),
        "torch CUDAGraph per segment": lambda: capture_piecewise_sizes(inputs, sizes, torch.cuda.graph_pool_handle(), stream),
    }
    if meta_library is not None:
        meta_way = functools.partial(MetaBreakable, meta_library)
        makers[META] = lambda: capture_piecewise_sizes(inputs, sizes, torch.cuda.graph_pool_handle(), stream, way=meta_way)
    ms = {name: [] for name in makers}
    worst = dict.fromkeys(makers, 0.0)
    warmed = {}
    for _ in range(repeats):  # alternate, so drift in the machine hits every variant
        for name, make in makers.items():
            elapsed, captured = timed_capture(make, 1)
            ms[name].append(elapsed)
            if isinstance(captured, bg.GraphRunner):
                warmed[name] = sum(row["warmed_up"] for row in captured.report(print_table=False)["rows"])
                run = runner_replay(inputs, captured)
            else:
                warmed[name] = len(sizes)
                run = graphs_replay(captured)
            worst[name] = max(worst[name], check_sizes(inputs, run, checked))
            del captured, run
    rows = [
        {
            "sizes": len(sizes),
            "variant": name,
            "capture_ms": round(statistics.median(values), 1),
            "ms_per_size": round(statistics.median(values) / len(sizes), 2),
            "sizes_warmed_up": warmed[name],
            "max_abs_diff_vs_eager": round(worst[name], 4),
        }
        for name, values in ms.items()
    ]
    median = {name: statistics.median(values) for name, values in ms.items()}
    ours, ours_each = median["breakgraph GraphRunner"], median["breakgraph GraphRunner, warm-up before every size"]
    ours_measured = median["breakgraph GraphRunner, measure_memory=True"]
    theirs = median["torch CUDAGraph per segment"]
    ratios = (
        f"torch-per-segment/breakgraph {theirs / ours:.2f}x; "
        f"torch-per-segment/breakgraph warm-up before every size {theirs / ours_each:.2f}x; "
        f"torch-per-segment/breakgraph measure_memory=True {theirs / ours_measured:.2f}x"
    )
    ratios += meta_ratios(median, {"breakgraph": ours})
    rows.append({"sizes": len(sizes), "variant": "ratios", "capture_ms": ratios})
    rows.append(first_use_row(inputs, sizes))
    return rows


def first_use_row(inputs: BatchInputs, sizes) -> dict:
    """A lazy runner serves at once: its first batch of a size pays that size's capture."""
    torch.cuda.empty_cache()  # the pools of the captures before it, freed untimed (see timed_capture)
    started = time.perf_counter()
    runner = capture_breakgraph_sizes(inputs, sizes, lazy=True)
    ready_ms = (time.perf_counter() - started) * 1000
    size = sizes[len(sizes) // 2]
    run = runner_replay(inputs, runner)
    run(size)  # first use: capture, then replay
    steady = []
    for _ in range(5):
        torch.cuda.synchronize()
        started = time.perf_counter()
        run(size)
        torch.cuda.synchronize()
        steady.append((time.perf_counter() - started) * 1000)
    first_use = runner.report(print_table=False)["rows"][0]["first_use_ms"]
    return {
        "sizes": len(sizes),
        "variant": "breakgraph GraphRunner, lazy=True",
        "capture_ms": f"ready in {ready_ms:.1f} ms; first batch of size {size} {first_use:.1f} ms, then {statistics.median(steady):.2f} ms",
    }


def main(argv=None) -> int:
    parser = benchmark_parser("capture_time", __doc__)
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers for the start-up part (16)")
    args = parser.parse_args(argv)
    require_gpu("capture_time")
    meta = device_meta()
    meta_library = load_meta()
    rows = break_count_rows([8, 64] if args.quick else [8, 64, 256], 2 if args.quick else 5, meta_library)
    write_outputs("capture_time", rows, ["breaks", "variant", "capture_ms"], args.out, meta, draw)

    config = DecoderConfig(layers=args.layers or (2 if args.quick else 16))
    sizes = bg.default_capture_sizes(16 if args.quick else 256)
    rows = startup_rows(config, sizes, 1 if args.quick else 3, meta_library)
    meta |= {"config": {k: str(v) for k, v in vars(config).items()}, "batch_sizes": sizes}
    columns = ["sizes", "variant", "capture_ms", "ms_per_size", "sizes_warmed_up", "max_abs_diff_vs_eager"]
    write_outputs("capture_startup", rows, columns, args.out, meta, draw_startup)
    return 0


def draw(ax, rows):
    plot_lines(ax, rows, "breaks", "capture_ms")
    ax.set_yscale("log")
    ax.set_xlabel("breaks in the region")
    ax.set_ylabel("capture time (ms, lower is better)")
    ax.set_title(f"Capture time ({torch.cuda.get_device_name()})")



def draw_startup(ax, rows):
    rows = [r for r in rows if isinstance(r["capture_ms"], float)]
    names = [r["variant"] for r in rows]
    ax.barh(names, [r["capture_ms"] for r in rows], color=["tab:blue", "tab:cyan", "tab:purple", "tab:orange", "tab:green"][: len(rows)])
    ax.set_xlabel(f"ms to capture the decoder at {rows[0]['sizes']} batch sizes (lower is better)")
    ax.set_title(f"Engine start-up capture\n{torch.cuda.get_device_name()}")


if __name__ == "__main__":
    raise SystemExit(main())
