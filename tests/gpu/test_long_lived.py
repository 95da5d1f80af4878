"""A process that lives as an engine's does: thousands of graphs made and dropped, captures
from several threads, then debug mode, a runner's report and pool sizes, still correct, with
no crash and no growth of reserved memory. Each runs in a fresh process (a crash is a
failure, not the end of the suite)."""

import gc
import subprocess
import sys
from collections import deque
from pathlib import Path

import torch

import breakgraph as bg
from tests.helpers import assert_close, normalized_model, poison_

DEV = "cuda"
ROOT = Path(__file__).resolve().parents[2]
SLACK = 64 * 2**20


def reserved_after_cleanup() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


def churn(count: int, threads: bool) -> None:
    """Make and drop ``count`` graphs, each with its own pool (a third never captured, a third
    captured and replayed, a third captured and reset; some kept a while and dropped out of
    order), with two-thread capture rounds every 100 graphs when ``threads``; then capture in
    debug mode, report a runner and read pool sizes, checking every replay against eager."""
    from tests.gpu.threads import Body, Worker, capture_concurrently

    w = torch.randn(64, 64, device=DEV) / 8
    x = torch.randn(16, 64, device=DEV)
    normalized_model(x, w)  # warm up: cuBLAS and kernels load outside the measurement
    workers = [Worker(index) for index in range(2)] if threads else []
    start = reserved_after_cleanup()
    kept = deque(maxlen=8)  # graphs a server keeps a while, dropped later and out of order
    for i in range(count):
        graph = bg.BreakableCUDAGraph()
        if i % 3 == 0:
            graph.pool  # a pool made, never captured into
        else:
            with bg.BreakableCUDAGraphCapture(graph):
                out = normalized_model(x, w)
            if i % 3 == 1:
                poison_(out)
                graph.replay()
                if i % 100 == 1:
                    assert_close(out, normalized_model(x, w), 1e-4, 1e-4)
            else:
                graph.reset()
            del out
        kept.append(graph)
        del graph
        if threads and i % 100 == 0:
            capture_concurrently(workers, Body(dropout=True, side_stream=True), "thread_local", "graph")
    kept.clear()

    # Past pool id 256 (thousands here): debug mode, the runner's report and pool sizes.
    debugged = bg.graphed(normalized_model, x, w, debug=True)
    breakable = bg.BreakableCUDAGraph(debug=True)
    with bg.BreakableCUDAGraphCapture(breakable):
        out = normalized_model(x, w)
    runner = bg.GraphRunner(lambda rows: normalized_model(rows, w), x.clone(), [4, 8, 16], progress=False).capture()
    report = runner.report(print_table=True)
    assert report["pool_bytes"] == bg.pool_bytes(runner.pool) > 0
    assert bg.pool_bytes(breakable.pool) > 0 and bg.pool_bytes(debugged.graph.pool) > 0
    for _ in range(3):
        fresh = torch.randn_like(x)
        x.copy_(fresh)
        expected = normalized_model(fresh, w)
        poison_(out)
        breakable.replay()
        assert_close(out, expected, 1e-4, 1e-4)
        poison_(debugged.output)
        assert_close(debugged.replay(), expected, 1e-4, 1e-4)
        assert_close(runner(fresh[:5]), expected[:5], 1e-4, 1e-4)
    del debugged, breakable, out, runner, workers
    end = reserved_after_cleanup()
    assert end - start <= SLACK, f"reserved memory grew by {(end - start) / 2**20:.1f} MiB over {count} graphs"
    print(f"OK: {count} graphs, reserved {start / 2**20:.1f} -> {end / 2**20:.1f} MiB")


def run_in_fresh_process(call: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", f"from tests.gpu.test_long_lived import churn; {call}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0 and "OK:" in done.stdout, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


def test_three_thousand_graphs_then_debug_mode_report_and_pool_sizes():
    run_in_fresh_process("churn(3000, threads=False)")


def test_three_thousand_graphs_interleaved_with_captures_in_two_threads():
    run_in_fresh_process("churn(3000, threads=True)")
