"""Pools shared within and across graphs, kept across reset; breaks keep nothing alive."""

import gc
import weakref

import torch

import breakgraph as bg
from breakgraph.base.pool import PoolUsage
from breakgraph.base.runtime import claim_capture_stream, run_on_stream
from tests.helpers import assert_close, poison_, scale_eager, softmax_eager

DEV = "cuda"


def test_pool_shared_within_and_across_graphs_and_kept_across_reset():
    first = bg.BreakableCUDAGraph()
    x = torch.randn(256, 256, device=DEV)
    x @ x  # cuBLAS makes this thread's handle at its first use, which a capture cannot hold
    with bg.BreakableCUDAGraphCapture(first):
        a = softmax_eager(x @ x) * 2
    pool = first.pool
    assert bg.pool_bytes(pool) > 0, "capture allocated nothing in the graph's pool"
    # Every segment's and every break's allocations live in the one pool.
    in_pool = lambda t: PoolUsage.of(pool).holds(t.data_ptr())
    assert in_pool(a) and in_pool(first.segments[1].result)

    second = bg.BreakableCUDAGraph(pool=first.pool)
    with bg.BreakableCUDAGraphCapture(second):
        b = scale_eager(a + 1) - 3
    assert second.pool is pool and in_pool(b)
    for _ in range(2):
        fresh = torch.randn_like(x)
        x.copy_(fresh)
        poison_(a), poison_(b)
        first.replay()
        second.replay()
        expected_a = torch.softmax(fresh @ fresh, -1) * 2
        assert_close(a, expected_a, 1e-4, 1e-4)
        assert_close(b, (expected_a + 1) * 2 - 3, 1e-4, 1e-4)

    first.reset()
    assert first.pool is pool and not first.captured
    with bg.BreakableCUDAGraphCapture(first):
        c = softmax_eager(x) + 1
    fresh = torch.randn_like(x)
    x.copy_(fresh)
    poison_(c)
    first.replay()
    assert_close(c, torch.softmax(fresh, -1) + 1)


def test_reset_and_recapture_many_times_does_not_grow_memory():
    graph = bg.BreakableCUDAGraph()
    x = torch.randn(64, 64, device=DEV)
    # Warm up on the capture stream: cuBLAS's handle and workspace are not the capture's to make.
    with claim_capture_stream(x.device) as stream:
        run_on_stream(stream, lambda: softmax_eager(x @ x))
    torch.cuda.synchronize()
    sizes = []
    for cycle in range(200):
        with bg.BreakableCUDAGraphCapture(graph):
            out = softmax_eager(x @ x) + 1
        graph.replay()
        del out
        graph.reset()
        if cycle in (20, 199):
            gc.collect()
            sizes.append((torch.cuda.memory_allocated(), bg.pool_bytes(graph.pool)))
    (allocated_early, pool_early), (allocated_late, pool_late) = sizes
    assert pool_late == pool_early and allocated_late <= allocated_early  # nothing grows


def test_break_arguments_are_not_kept_alive():
    graph = bg.BreakableCUDAGraph()
    x = torch.randn(1024, device=DEV)
    with bg.BreakableCUDAGraphCapture(graph):
        temp = x * 2
        ref = weakref.ref(temp)
        out = scale_eager(temp, factor=3.0) + 1
        del temp
    gc.collect()
    assert ref() is None, "the break's argument was kept alive by the graph"
    fresh = torch.randn_like(x)
    x.copy_(fresh)
    poison_(out)
    graph.replay()
    assert_close(out, fresh * 6 + 1)


def test_break_results_are_not_kept_alive_and_their_bytes_are_reused():
    graph = bg.BreakableCUDAGraph()
    x = torch.randn(1 << 20, device=DEV)  # 4 MiB per activation
    layers = 32
    with bg.BreakableCUDAGraphCapture(graph):
        h = x
        first = scale_eager(h, factor=1.0)
        ref = weakref.ref(first)
        h = first + 1
        del first
        for _ in range(layers - 1):
            h = scale_eager(h, factor=1.0) + 1
        out = h
    gc.collect()
    assert ref() is None, "the break's result was kept alive by the graph"
    held = bg.pool_bytes(graph.pool)
    assert held < 8 * x.nbytes, f"pool holds {held} bytes: break results were pinned"
    for _ in range(2):
        fresh = torch.randn_like(x)
        x.copy_(fresh)
        poison_(out)
        graph.replay()
        assert_close(out, fresh + layers)
