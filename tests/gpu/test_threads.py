"""Several threads capturing at once on one device, under each capture mode that lets them and
each way of treating random ops; every replay checked against eager, 20 rounds in a row."""

import contextlib
import itertools

import pytest
import torch

import breakgraph as bg
from tests.gpu.threads import Body, Worker, capture_concurrently, run_together, scale_in_place
from tests.helpers import assert_close, poison_


BODIES = {
    "plain": Body(),
    "dropout": Body(dropout=True),
    "side stream": Body(side_stream=True),
    "dropout and side stream": Body(dropout=True, side_stream=True),
}


@pytest.mark.parametrize(
    "threads, mode, random_ops, body",
    list(itertools.product([2, 4], ["thread_local", "relaxed"], ["graph", "break"], BODIES)),
)
def test_threads_capture_at_once_and_replay_like_eager(threads, mode, random_ops, body):
    workers = [Worker(index) for index in range(threads)]
    capture_concurrently(workers, BODIES[body], mode, random_ops, rounds=20)


def test_threads_capture_at_once_in_debug_mode():
    workers = [Worker(index) for index in range(2)]
    capture_concurrently(workers, BODIES["dropout and side stream"], "thread_local", "graph", rounds=5, debug=True)


def test_new_threads_capture_while_torch_hands_its_pooled_streams_out_again():
    """torch hands out its 32 pooled streams per device round robin, so a stream a new thread
    takes can be the one another thread is capturing on. Fresh threads every round, the pool
    advanced one stream further each time, so every alignment comes up: nothing breakgraph
    takes for itself may collide with a worker's capture stream."""
    workers = [Worker(index) for index in range(2)]
    kept_alive = []
    for _ in range(40):
        capture_concurrently(workers, BODIES["dropout and side stream"], "thread_local", "graph")
        kept_alive.append(torch.cuda.Stream())


def _capture_scaled(x, buf, stream=None):
    """A graph of ``x * 3 + 1`` through ``buf`` (kept alive by the caller: the graph does not)
    with a break in between, captured on ``stream`` (None: a stream of breakgraph's own);
    returns the graph, its output and the stream it used."""
    graph = bg.BreakableCUDAGraph()
    with bg.BreakableCUDAGraphCapture(graph, stream=stream, capture_error_mode="thread_local"):
        buf.copy_(x)
        scale_in_place(buf, 3.0)
        out = buf + 1.0
        used = torch.cuda.current_stream()
    return graph, out, used


def _check_scaled(graph, x, out):
    fresh = torch.randn_like(x)
    x.copy_(fresh)
    poison_(out)
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, fresh * 3.0 + 1.0)


def test_captures_at_once_take_streams_of_their_own_that_torchs_pool_never_hands_out():
    """Two threads capture at once on their own streams, neither ever one of torch's 32 pooled
    streams (which NCCL's internal stream and a model's ``torch.cuda.Stream()`` come from);
    once both have ended, the next capture takes one of those two again rather than a new one."""
    x_a, x_b = torch.randn(1024, device="cuda"), torch.randn(1024, device="cuda")
    buf_a, buf_b = torch.empty_like(x_a), torch.empty_like(x_b)
    results = {}

    def thread_a(barrier):
        graph = bg.BreakableCUDAGraph()
        with bg.BreakableCUDAGraphCapture(graph, capture_error_mode="thread_local"):
            buf_a.copy_(x_a)
            scale_in_place(buf_a, 3.0)
            results["a"] = (graph, buf_a + 1.0, torch.cuda.current_stream())
            barrier.wait()  # B now captures while A's capture is open
            barrier.wait()

    def thread_b(barrier):
        barrier.wait()
        results["b"] = _capture_scaled(x_b, buf_b)
        barrier.wait()

    run_together([thread_a, thread_b])
    (graph_a, out_a, stream_a), (graph_b, out_b, stream_b) = results["a"], results["b"]
    used = {stream_a.cuda_stream, stream_b.cuda_stream}
    assert len(used) == 2
    pooled = {torch.cuda.Stream().cuda_stream for _ in range(64)}  # every stream of the pool, twice round
    assert not used & pooled
    _check_scaled(graph_a, x_a, out_a)
    _check_scaled(graph_b, x_b, out_b)
    for _ in range(3):
        graph, out, stream = _capture_scaled(x_a, buf_a)
        assert stream.cuda_stream in used
        _check_scaled(graph, x_a, out)


def test_two_captures_on_one_stream_at_once_fail_clearly_and_the_first_goes_on():
    stream = torch.cuda.Stream()
    x_a, x_b = torch.randn(1024, device="cuda"), torch.randn(1024, device="cuda")
    buf_a, buf_b = torch.empty_like(x_a), torch.empty_like(x_b)
    results = {}

    def thread_a(barrier):
        graph = bg.BreakableCUDAGraph()
        with bg.BreakableCUDAGraphCapture(graph, stream=stream, capture_error_mode="thread_local"):
            buf_a.copy_(x_a)
            scale_in_place(buf_a, 3.0)
            results["a"] = (graph, buf_a + 1.0)
            barrier.wait()
            barrier.wait()

    def thread_b(barrier):
        barrier.wait()
        try:
            with pytest.raises(RuntimeError, match="already being captured on by another capture"):
                _capture_scaled(x_b, buf_b, stream=stream)
        finally:
            barrier.wait()

    run_together([thread_a, thread_b])
    graph_a, out_a = results["a"]
    _check_scaled(graph_a, x_a, out_a)
    graph_b, out_b, _ = _capture_scaled(x_b, buf_b, stream=stream)  # the stream is free again
    _check_scaled(graph_b, x_b, out_b)


SYNCS = {
    "the device": lambda: torch.cuda.synchronize(),
    "another stream": lambda: torch.cuda.Stream().synchronize(),
}
# (what thread B synchronizes, capture mode) -> whether CUDA invalidates thread A's capture
INVALIDATES = {
    ("the device", "global"): True,
    ("the device", "thread_local"): True,
    ("the device", "relaxed"): True,
    ("another stream", "global"): True,  # any unsafe call in any thread, under global mode
    ("another stream", "thread_local"): False,
    ("another stream", "relaxed"): False,
}


@pytest.mark.parametrize("synchronized, mode", list(INVALIDATES))
def test_a_synchronize_in_another_thread_mid_capture_fails_clearly_or_not_at_all_and_the_next_capture_works(
    synchronized, mode
):
    x, buf = torch.randn(1024, device="cuda"), torch.empty(1024, device="cuda")
    outcome = {}

    def capturing(barrier):
        graph = bg.BreakableCUDAGraph()
        try:
            with bg.BreakableCUDAGraphCapture(graph, capture_error_mode=mode):
                buf.copy_(x)
                scale_in_place(buf, 3.0)  # a break, then the segment the other thread meets
                barrier.wait()  # B synchronizes now
                barrier.wait()
                out = buf + 1.0
            outcome["captured"] = (graph, out)
        except bg.CaptureInvalidatedError as error:
            outcome["error"] = error

    def synchronizing(barrier):
        barrier.wait()
        with contextlib.suppress(RuntimeError):  # CUDA refuses B's call too, where it invalidates
            SYNCS[synchronized]()
        barrier.wait()

    run_together([capturing, synchronizing])
    if INVALIDATES[(synchronized, mode)]:
        text = str(outcome["error"])
        assert "invalidated from outside" in text and "torch.cuda.synchronize()" in text and "thread_local" in text
    else:
        graph, out = outcome["captured"]
        _check_scaled(graph, x, out)
    graph, out, _ = _capture_scaled(x, buf)  # nothing was left behind
    _check_scaled(graph, x, out)
