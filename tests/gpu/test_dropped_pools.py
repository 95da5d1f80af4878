"""Dropped graphs give their memory back, as torch's do, and never the memory of outputs
still held; the allocator's own cache is left alone.

Where a pool's memory is, is read from the allocator's snapshot by pool id, so each
check names exactly the pool it means. The recapture loop runs in a fresh process: its
reserved memory must not carry anything of the tests before it.
"""

import subprocess
import sys
from pathlib import Path

import torch

import breakgraph as bg
from tests.helpers import assert_close, poison_

DEV = "cuda"
ROOT = Path(__file__).resolve().parents[2]
FLAT = 64 * 2**20


@bg.eager_on_graph
def halve(t):
    return t * 0.5


def body(x, w):
    """The issue's body: a matmul, an eager break, a matmul."""
    return halve(x @ w).relu() @ w


def operands() -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh ``(x, w)`` for :func:`body`."""
    return torch.randn(64, 256, device=DEV), torch.randn(256, 256, device=DEV) / 16


def pool_segments(pool_id) -> list[dict]:
    return [segment for segment in torch.cuda.memory_snapshot() if tuple(segment["segment_pool_id"]) == tuple(pool_id)]


def holds(pool_id, tensor_or_address) -> bool:
    """Whether a segment of the pool spans the tensor's (or the address's) memory."""
    address = tensor_or_address if isinstance(tensor_or_address, int) else tensor_or_address.data_ptr()
    return any(s["address"] <= address < s["address"] + s["total_size"] for s in pool_segments(pool_id))


def caches(pool_id) -> bool:
    """Whether the pool keeps a segment nothing uses. (One torch uses may stay: cuBLAS's
    workspace for a capture stream is allocated in the pool of the stream's first capture.)"""
    return any(all(block["state"] != "active_allocated" for block in s["blocks"]) for s in pool_segments(pool_id))


def recapture_loop(graphs: int = 3000, every: int = 10, torch_graphs: bool = False) -> int:
    """Make ``graphs`` graphs, capture one in ``every``, keep the latest output and drop each
    graph; return how much reserved memory grew (no ``empty_cache()`` anywhere)."""
    x, w = operands()
    expected = body(x, w)  # also the warm-up: cuBLAS loads outside the measurement
    torch.cuda.synchronize()
    start = torch.cuda.memory_reserved()
    out = None
    for i in range(graphs):
        graph = torch.cuda.CUDAGraph() if torch_graphs else bg.BreakableCUDAGraph()
        if i % every == 0:
            if torch_graphs:
                with torch.cuda.graph(graph):
                    y = (x @ w * 0.5).relu() @ w
            else:
                with bg.BreakableCUDAGraphCapture(graph):
                    y = body(x, w)
            poison_(y)
            graph.replay()
            out = y
        del graph
    torch.cuda.synchronize()
    assert_close(out, expected, 1e-4, 1e-4)
    return torch.cuda.memory_reserved() - start


def run_loop_in_fresh_process() -> None:
    growth = recapture_loop()
    torch_growth = recapture_loop(torch_graphs=True)
    print(f"breakgraph {growth / 2**20:.1f} MiB, torch {torch_growth / 2**20:.1f} MiB")
    assert growth <= FLAT, f"reserved memory grew by {growth / 2**20:.1f} MiB over 300 captures and 3000 graphs"
    print("OK")


def test_recapturing_keeps_reserved_memory_flat_without_empty_cache():
    done = subprocess.run(
        [sys.executable, "-c", "from tests.gpu.test_dropped_pools import run_loop_in_fresh_process as r; r()"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0 and "OK" in done.stdout, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    print(done.stdout)


def capture(graph, x, w):
    body(x, w)  # warm up: cuBLAS makes its handle outside the capture
    torch.cuda.synchronize()
    with bg.BreakableCUDAGraphCapture(graph):
        out = body(x, w)
    poison_(out)
    graph.replay()
    return out


def test_an_output_held_past_its_graph_stays_valid_and_its_memory_goes_back_once_dropped():
    x, w = operands()
    graph = bg.BreakableCUDAGraph()
    out = capture(graph, x, w)
    expected = body(x, w)
    pool_id = graph.pool.id
    del graph  # everything the output does not hold goes back now
    assert holds(pool_id, out)
    # Fresh allocations of every size, written all over: none may land on the held output.
    fillers = [torch.full((n,), 7.0, device=DEV) for n in (1, 100, 4096, 16384, 2**20, 2**22) for _ in range(8)]
    torch.cuda.synchronize()
    assert_close(out, expected, 1e-4, 1e-4)
    assert all(not holds(pool_id, filler) for filler in fillers)
    address = out.data_ptr()
    del fillers, out
    assert holds(pool_id, address) and caches(pool_id)  # the dead pool's cache
    bg.BreakableCUDAGraph().pool  # another graph's pool, made and dropped: the dead pool's cache goes too
    assert not holds(pool_id, address) and not caches(pool_id)


def test_memory_held_past_a_graph_goes_back_at_the_next_capture_start():
    x, w = operands()
    graph = bg.BreakableCUDAGraph()
    out = capture(graph, x, w)
    pool_id, address = graph.pool.id, out.data_ptr()
    del graph
    del out  # back in the dead pool's cache
    assert holds(pool_id, address) and caches(pool_id)
    later = bg.BreakableCUDAGraph()
    capture(later, x, w)
    assert not holds(pool_id, address) and not caches(pool_id)


def test_a_shared_pool_goes_back_when_the_last_graph_sharing_it_goes():
    x, w = operands()
    first = bg.BreakableCUDAGraph()
    first_out = capture(first, x, w)
    second = bg.BreakableCUDAGraph(pool=first.pool)
    second_x = torch.randn_like(x)
    second_out = capture(second, second_x, w)
    pool_id, address = first.pool.id, second_out.data_ptr()
    del first, first_out
    fresh = torch.randn_like(x)
    second_x.copy_(fresh)
    poison_(second_out)
    second.replay()
    assert_close(second_out, body(fresh, w), 1e-4, 1e-4)
    assert holds(pool_id, address)
    del second_out, second  # the output first: the pool dies holding nothing, so all of it goes at once
    assert not holds(pool_id, address) and not caches(pool_id)


def test_a_released_or_dropped_runner_gives_its_pool_back():
    w = torch.randn(256, 256, device=DEV) / 16
    x = torch.randn(32, 256, device=DEV)
    for drop in (False, True):
        runner = bg.GraphRunner(lambda rows: body(rows, w), x.clone(), [8, 16, 32], progress=False).capture()
        assert_close(runner(x[:5]), body(x[:5], w), 1e-4, 1e-4)
        pool_id = runner.pool.id
        held = bg.pool_bytes(runner.pool)
        if drop:
            del runner
        else:
            runner.release(keep_graphs=False)
        left = sum(s["total_size"] for s in pool_segments(pool_id))
        assert not caches(pool_id) and left < held, (left, held)


def test_giving_dead_pools_memory_back_leaves_the_allocators_own_cache_alone():
    cached = torch.empty(64 * 2**20, dtype=torch.uint8, device=DEV)
    address = cached.data_ptr()
    del cached  # cached by the allocator, in no pool of breakgraph's
    w = torch.randn(256, 256, device=DEV) / 16
    graph = bg.BreakableCUDAGraph()
    capture(graph, torch.randn(64, 256, device=DEV), w)
    del graph
    later = bg.BreakableCUDAGraph()
    capture(later, torch.randn(64, 256, device=DEV), w)
    assert any(s["address"] <= address < s["address"] + s["total_size"] for s in pool_segments((0, 0)))
