"""Breaks in both graph modes: capturable variants inline in full graphs, capture stubs in breakable ones."""

import pytest
import torch

import breakgraph as bg
import breakgraph_bindings as bindings
from tests.helpers import assert_close, poison_

DEV = "cuda"
CAPACITY = 64


class Meta:
    """What an engine updates before every step: the live length, on the host and on the device."""

    def __init__(self, batch: int):
        self.length = 10
        self.lengths = torch.full((batch,), 10, device=DEV)

    def set(self, length: int) -> None:
        self.length = length
        self.lengths.fill_(length)


@bg.eager_on_graph
def attend(q, cache, meta):
    """Attention over the live prefix; its length is a host int, so shapes change every step."""
    live = cache[:, : meta.length]
    return torch.softmax(q @ live.transpose(1, 2) / 4, -1) @ live


@attend.inline
def attend_from_device_lengths(q, cache, meta):
    """The same attention over the whole cache, masked by lengths read from the device."""
    scores = q @ cache.transpose(1, 2) / 4
    live = torch.arange(CAPACITY, device=DEV) < meta.lengths[:, None, None]
    return torch.softmax(scores.masked_fill(~live, float("-inf")), -1) @ cache


def model(x, cache, w, meta):
    for _ in range(3):
        h = torch.tanh(x @ w)
        x = x + attend(h, cache, meta)
    return x * 2


@pytest.mark.parametrize("breaks, graphs, eager_breaks", [("eager", 4, 3), ("inline", 1, 0)])
def test_a_break_with_a_capturable_variant_in_both_modes_equals_eager(breaks, graphs, eager_breaks):
    batch = 4
    x = torch.randn(batch, 2, 16, device=DEV)
    cache = torch.randn(batch, CAPACITY, 16, device=DEV)
    w = torch.randn(16, 16, device=DEV) / 4
    meta = Meta(batch)
    model(x, cache, w, meta)  # warm up
    graph = bg.BreakableCUDAGraph()
    with bg.BreakableCUDAGraphCapture(graph, breaks=breaks):
        out = model(x, cache, w, meta)
    assert (graph.num_graphs, graph.num_eager_breaks) == (graphs, eager_breaks)
    for length in (5, 17, 40, 64):
        meta.set(length)
        fresh_x, fresh_cache = torch.randn_like(x), torch.randn_like(cache)
        x.copy_(fresh_x), cache.copy_(fresh_cache)
        poison_(out)
        graph.replay()
        assert_close(out, model(fresh_x, fresh_cache, w, meta), 1e-4, 1e-4)


def _assert_clean(caller):
    assert not bg.is_capturing() and torch.cuda.current_stream() == caller
    assert bindings.capture_status(torch.cuda.current_stream()) is bindings.CaptureStatus.NONE


def test_inline_capture_of_a_break_that_reads_a_host_value_fails_and_leaves_nothing_behind():
    @bg.eager_on_graph
    def host_sized(x, meta):
        return x[: meta.length] * 2  # a host int decides the shape: a full graph would freeze it

    caller = torch.cuda.current_stream()
    meta = Meta(1)
    graph = bg.BreakableCUDAGraph()
    with pytest.raises(bg.UncapturableOpError, match="breaks='eager'") as info:
        with bg.BreakableCUDAGraphCapture(graph, breaks="inline"):
            host_sized(torch.ones(32, device=DEV) + 1, meta)
    assert "host_sized() has no capturable variant" in str(info.value)
    assert not graph.captured
    _assert_clean(caller)
    with bg.BreakableCUDAGraphCapture(graph):  # the breakable mode takes it
        out = host_sized(torch.ones(32, device=DEV) + 1, meta)
    graph.replay()
    assert_close(out, torch.full((10,), 4.0, device=DEV))


def test_inline_variant_that_synchronizes_is_refused_with_the_fix():
    @bg.eager_on_graph(inline=True)
    def counts(x):
        return x * int((x > 0).sum().item())

    caller = torch.cuda.current_stream()
    with pytest.raises(bg.UncapturableOpError, match="cannot be captured inline") as info:
        with bg.BreakableCUDAGraphCapture(bg.BreakableCUDAGraph(), breaks="inline"):
            counts(torch.randn(8, device=DEV) * 2)
    assert "breaks='eager'" in str(info.value)
    _assert_clean(caller)


def test_inline_true_captures_the_function_itself_and_break_graph_splits_nothing():
    @bg.eager_on_graph(inline=True)
    def double(x):
        return x * 2

    x = torch.randn(16, device=DEV)
    graph = bg.BreakableCUDAGraph()
    with bg.BreakableCUDAGraphCapture(graph, breaks="inline"):
        y = double(x + 1)
        bg.break_graph()
        out = double(y) - 1
    assert graph.num_graphs == 1 and graph.num_eager_breaks == 0
    fresh = torch.randn_like(x)
    x.copy_(fresh)
    poison_(out)
    graph.replay()
    assert_close(out, (fresh + 1) * 4 - 1)


def test_capture_stub_runs_at_capture_and_the_body_at_replay():
    calls = []

    def stub(x):
        calls.append("stub")
        return torch.empty_like(x)

    @bg.eager_on_graph(capture_stub=stub)
    def expensive(x):
        calls.append("body")
        return x.cumsum(0)

    x = torch.randn(32, device=DEV)
    graph = bg.BreakableCUDAGraph()
    with bg.BreakableCUDAGraphCapture(graph):
        out = expensive(x * 2) + 1
    assert calls == ["stub"]
    for _ in range(2):
        fresh = torch.randn_like(x)
        x.copy_(fresh)
        poison_(out)
        graph.replay()
        assert_close(out, (fresh * 2).cumsum(0) + 1, 1e-4, 1e-4)
    assert calls == ["stub", "body", "body"]


def test_capture_stub_with_the_wrong_shape_is_caught_at_replay():
    @bg.eager_on_graph(capture_stub=lambda x: torch.empty(3, device=DEV))
    def body(x):
        return x * 2

    x = torch.randn(8, device=DEV)
    graph = bg.BreakableCUDAGraph()
    with bg.BreakableCUDAGraphCapture(graph):
        body(x) + 1
    with pytest.raises(bg.WritebackError, match=r"body\(\) -> out: shape \(3,\) at capture, \(8,\) at replay"):
        graph.replay()


@pytest.mark.parametrize("breaks, ran_before_capture", [("inline", "variant"), ("eager", "function")])
def test_warm_up_runs_what_the_capture_records(breaks, ran_before_capture):
    """A full graph records the variants, so its warm-up runs them (a kernel library's first-call
    set-up must not land inside the capture); a breakable graph's warm-up runs the functions."""
    calls = []

    @bg.eager_on_graph
    def scale(x):
        calls.append(("function", bg.is_capturing()))
        return x * 2

    @scale.inline
    def scale_in_graph(x):
        calls.append(("variant", bg.is_capturing()))
        return x * 2

    x = torch.randn(8, device=DEV)
    step = bg.graphed(lambda v: scale(v + 1), x, warmup=1, breaks=breaks)
    assert calls[0] == (ran_before_capture, False)
    x.copy_(torch.randn(8, device=DEV))
    poison_(step.output)
    assert_close(step.replay(), (x + 1) * 2, 0, 0)
    assert scale(x) is not None and calls[-1] == ("function", False)  # outside any capture: the function
