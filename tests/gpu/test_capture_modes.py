"""Capture modes, the capture stream and the caller's, and captures in two threads at once."""

import threading

import pytest
import torch

import breakgraph as bg
from breakgraph.base.runtime import on_stream
from tests.helpers import assert_close, check_against_eager, poison_, scale_eager, softmax_eager

DEV = "cuda"


def test_on_stream_sets_and_restores_the_current_stream_as_torch_does():
    caller, side = torch.cuda.current_stream(), torch.cuda.Stream()
    with on_stream(side) as current:
        assert current is side and torch.cuda.current_stream() == side
        with on_stream(caller):
            assert torch.cuda.current_stream() == caller
        assert torch.cuda.current_stream() == side
    assert torch.cuda.current_stream() == caller
    with pytest.raises(RuntimeError, match="inside"):
        with on_stream(side):
            raise RuntimeError("inside")
    assert torch.cuda.current_stream() == caller and torch.cuda.current_device() == side.device_index


def test_capture_error_modes():
    for mode in ("global", "thread_local", "relaxed"):
        check_against_eager(lambda x: softmax_eager(x) * 2, [torch.randn(4, 8, device=DEV)], capture_error_mode=mode)
    with pytest.raises(ValueError, match="capture_error_mode"):
        bg.BreakableCUDAGraphCapture(bg.BreakableCUDAGraph(), capture_error_mode="loose")


@pytest.mark.parametrize("mode", ["global", "thread_local"])
def test_capture_follows_the_callers_pending_work(mode):
    x = torch.zeros(1 << 16, device=DEV)
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # keep the caller's stream busy
    x.fill_(3.0)  # still pending when the capture starts
    seen = {}

    @bg.eager_on_graph
    def read(t):
        seen["value"] = t.max().item()  # a host sync: fine inside a break
        return t * 2

    graph = bg.BreakableCUDAGraph()
    with bg.BreakableCUDAGraphCapture(graph, capture_error_mode=mode):
        out = read(x) + 1
    assert seen["value"] == 3.0, "the break ran before the caller's pending work"
    x.fill_(5.0)
    poison_(out)
    graph.replay()
    assert_close(out, torch.full_like(x, 11.0))


def test_concurrent_captures_in_two_threads():
    results, errors = {}, []
    barrier = threading.Barrier(2)

    def work(tag, factor):
        try:
            stream = torch.cuda.Stream()
            graph = bg.BreakableCUDAGraph()
            x = inputs[tag].clone()  # not drawn here: the other thread's capture may hold the generator
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                x = x + 0
                x @ x  # cuBLAS handles are per thread: create this thread's outside the capture
            stream.synchronize()
            barrier.wait()
            with bg.BreakableCUDAGraphCapture(graph, stream=stream, capture_error_mode="thread_local"):
                barrier.wait()  # both threads are capturing now
                y = softmax_eager(x * factor)
                out = scale_eager(y @ y, factor)
                barrier.wait()
            assert graph.num_eager_breaks == 2
            checks = []
            for fresh in refills[tag]:
                with torch.cuda.stream(stream):  # refill and poison in the replay's stream order
                    x.copy_(fresh)
                    poison_(out)
                    graph.replay()
                stream.synchronize()
                y = torch.softmax(fresh * factor, -1)
                checks.append(torch.allclose(out, (y @ y) * factor, atol=1e-4, rtol=1e-4))
            results[tag] = checks
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)
            barrier.abort()

    inputs = [torch.randn(128, 128, device=DEV) for _ in range(2)]
    refills = [[torch.randn(128, 128, device=DEV) for _ in range(2)] for _ in range(2)]
    torch.cuda.synchronize()  # drawn on this thread's stream: ready before the threads read them
    threads = [threading.Thread(target=work, args=(i, 1.5 + i)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results == {0: [True, True], 1: [True, True]}
