"""The capture-time barrier: called after every segment ends and before each break runs, and at the end."""

import pytest
import torch

import breakgraph as bg
import breakgraph_bindings as bindings
from tests.helpers import assert_close

DEV = "cuda"


def test_barrier_runs_between_segment_end_and_break_and_at_capture_end():
    events = []
    stream = torch.cuda.Stream()

    def barrier():
        capturing = bindings.capture_status(stream) is not bindings.CaptureStatus.NONE
        events.append(("barrier", capturing))

    @bg.eager_on_graph
    def first(x):
        events.append(("first", bg.is_capturing()))
        return x + 1

    @bg.eager_on_graph
    def second(x):
        events.append(("second", bg.is_capturing()))
        return x * 3

    x = torch.randn(8, device=DEV)
    graph = bg.BreakableCUDAGraph()
    with bg.BreakableCUDAGraphCapture(graph, stream=stream, barrier_fn=barrier):
        out = second(first(x * 2) - 1) + 5
    # No segment is recording while the barrier runs; each break follows its barrier.
    assert events == [("barrier", False), ("first", True), ("barrier", False), ("second", True), ("barrier", False)]
    events.clear()
    fresh = torch.randn_like(x)
    x.copy_(fresh)
    graph.replay()
    assert_close(out, (fresh * 2 + 1 - 1) * 3 + 5)
    assert [name for name, _ in events] == ["first", "second"]  # the barrier is for capture only


def test_barrier_that_raises_fails_the_capture_cleanly():
    class Late(Exception):
        pass

    def barrier():
        raise Late("rank 1 did not arrive")

    with pytest.raises(Late):
        with bg.BreakableCUDAGraphCapture(bg.BreakableCUDAGraph(), barrier_fn=barrier):
            bg.break_graph()
    assert not bg.is_capturing()
    graph = bg.BreakableCUDAGraph()
    with bg.BreakableCUDAGraphCapture(graph):
        y = torch.ones(4, device=DEV) * 2
    graph.replay()
    assert_close(y, torch.full((4,), 2.0, device=DEV))
