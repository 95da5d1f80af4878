"""Replay hooks: called once per replay, before and after the segments, in order."""

import pytest
import torch

import breakgraph as bg
from tests.helpers import assert_close

DEV = "cuda"


def test_replay_hooks_run_once_per_replay_around_the_segments():
    events = []

    @bg.eager_on_graph
    def middle(x):
        events.append("break")
        return x + 1

    x = torch.randn(8, device=DEV)
    graph = bg.BreakableCUDAGraph()
    with bg.BreakableCUDAGraphCapture(graph):
        out = middle(x * 2) * 3
    events.clear()  # the break's call at capture
    graph.set_replay_hooks(before=lambda: events.append("before"), after=lambda: events.append("after"))
    for _ in range(2):
        graph.replay()
    assert events == ["before", "break", "after"] * 2
    assert_close(out, (x * 2 + 1) * 3)
    events.clear()
    graph.set_replay_hooks()  # removed: nothing runs
    graph.replay()
    assert events == ["break"]
    with pytest.raises(TypeError, match="callable"):
        graph.set_replay_hooks(before=3)



def test_a_break_that_raises_at_replay_leaves_the_graph_and_the_thread_usable():
    fail = {"now": False}

    @bg.eager_on_graph
    def flaky(x):
        if fail["now"]:
            raise ValueError("the engine's metadata was not ready")
        return x + 1

    x = torch.randn(8, device=DEV)
    graph = bg.BreakableCUDAGraph()
    with bg.BreakableCUDAGraphCapture(graph):
        out = flaky(x * 2) * 3
    fail["now"] = True
    with pytest.raises(ValueError, match="not ready"):
        graph.replay()
    fail["now"] = False
    fresh = torch.randn_like(x)
    x.copy_(fresh)
    graph.replay()
    assert_close(out, (fresh * 2 + 1) * 3)
    other = bg.BreakableCUDAGraph()  # and the next capture on this thread works
    with bg.BreakableCUDAGraphCapture(other):
        y = flaky(x) - 1
    other.replay()
    assert_close(y, fresh)
