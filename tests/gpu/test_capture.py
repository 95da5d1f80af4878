"""Capture and replay on a real GPU: breaks anywhere, arguments of every shape, compared with eager."""


import pytest
import torch

import breakgraph as bg
from tests.helpers import assert_close, check_against_eager, poison_, scale_eager, softmax_eager

DEV = "cuda"



def test_break_in_the_middle():
    w = torch.randn(64, 64, device=DEV)

    def fn(x):
        y = torch.relu(x @ w)
        y = softmax_eager(y)
        return y @ w + 1

    graph, _ = check_against_eager(fn, [torch.randn(16, 64, device=DEV)])
    assert [s.kind for s in graph.segments] == ["graph", "eager", "graph"]
    assert graph.num_graphs == 2 and graph.num_eager_breaks == 1


def test_break_at_start_and_end():
    def fn(x):
        y = scale_eager(x)
        y = y.sin() * 3
        return softmax_eager(y)

    graph, _ = check_against_eager(fn, [torch.randn(8, 32, device=DEV)])
    assert [s.kind for s in graph.segments] == ["eager", "graph", "eager"]


def test_many_breaks():
    def fn(x):
        for i in range(40):
            x = x * 0.9 + i
            x = scale_eager(x, 1.01) if i % 2 else softmax_eager(x)
        return x

    graph, _ = check_against_eager(fn, [torch.randn(4, 16, device=DEV)], atol=1e-4, rtol=1e-4)
    assert graph.num_eager_breaks == 40
    assert graph.num_graphs == 40  # one segment after every break, none empty before the first


def test_consecutive_breaks_make_no_empty_segments():
    def fn(x):
        a = scale_eager(x)
        b = softmax_eager(a)
        bg.break_graph()
        return scale_eager(b, 3.0) + 1

    graph, _ = check_against_eager(fn, [torch.randn(4, 16, device=DEV)])
    assert [s.kind for s in graph.segments] == ["eager", "eager", "eager", "eager", "graph"]
    assert all(s.num_nodes > 0 for s in graph.segments if s.kind == "graph")


def test_enable_false_is_captured_in_the_graph():
    @bg.eager_on_graph(enable=False)
    def plain(x):
        return x + 1

    graph, _ = check_against_eager(lambda x: plain(x) * 2, [torch.randn(8, device=DEV)])
    assert graph.num_eager_breaks == 0 and graph.num_graphs == 1


def test_bound_methods():
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(32, 32, device=DEV)

        @bg.eager_on_graph
        def mix(self, x):
            return torch.cumsum(x, dim=-1) / x.shape[-1]

        def forward(self, x):
            return self.lin(self.mix(self.lin(x)))

    layer = Layer()
    graph, _ = check_against_eager(layer, [torch.randn(8, 32, device=DEV)], atol=1e-4, rtol=1e-4)
    assert graph.num_eager_breaks == 1


def test_kwargs_and_nested_container_args():
    @bg.eager_on_graph
    def combine(x, *, parts, weights):
        a, (b, c) = parts["a"], parts["rest"]
        return x * weights[0] + a - b * c * weights[1]

    def fn2(x, a, b, c):
        return combine(x + 1, parts={"a": a * 2, "rest": (b, c)}, weights=(0.5, 2.0)) * 3

    check_against_eager(fn2, [torch.randn(8, 8, device=DEV) for _ in range(4)])


def test_gemm_and_reductions_with_several_breaks():
    w1, w2 = torch.randn(128, 256, device=DEV) / 16, torch.randn(256, 128, device=DEV) / 16

    def fn(x):
        h = torch.relu(x @ w1)
        h = softmax_eager(h)
        m = h.mean(dim=0, keepdim=True)
        h = scale_eager(h - m)
        s = h.sum(dim=-1, keepdim=True)
        h = softmax_eager(h / (s.abs() + 1))
        return (h @ w2).norm(dim=-1)

    graph, _ = check_against_eager(fn, [torch.randn(32, 128, device=DEV)], atol=1e-4, rtol=1e-4)
    assert graph.num_eager_breaks == 3


def test_breaks_returning_non_tensors():
    seen = []

    @bg.eager_on_graph
    def count(x):
        seen.append(x.shape[0])
        return len(seen)

    @bg.eager_on_graph
    def note(x, label):
        return f"{label}:{x.dtype}"

    @bg.eager_on_graph
    def nothing(x):
        return None

    def fn(x):
        n = count(x)
        text = note(x, "t")
        nothing(x)
        return x * 2 + n, text

    graph = bg.BreakableCUDAGraph()
    x = torch.randn(4, device=DEV)
    with bg.BreakableCUDAGraphCapture(graph):
        out, text = fn(x)
    assert text == "t:torch.float32" and graph.num_eager_breaks == 3
    for _ in range(2):
        fresh = torch.randn_like(x)
        x.copy_(fresh)
        poison_(out)
        graph.replay()
        # n was 1 at capture: the graph keeps the captured scalar, the break still runs.
        assert_close(out, fresh * 2 + 1)
    assert len(seen) == 3


def test_deep_call_stack():
    def descend(x, depth):
        if depth == 0:
            return softmax_eager(x)
        return descend(x + 0.01, depth - 1) * 1.0

    check_against_eager(lambda x: descend(x, 60), [torch.randn(4, 8, device=DEV)], atol=1e-4, rtol=1e-4)


def test_is_capturing_in_graph_and_eager_parts_not_on_replay():
    seen = []

    @bg.eager_on_graph
    def probe(x):
        seen.append(("break", bg.is_capturing()))
        return x + 1

    graph = bg.BreakableCUDAGraph()
    x = torch.randn(4, device=DEV)
    assert not bg.is_capturing()
    with bg.BreakableCUDAGraphCapture(graph):
        seen.append(("graph", bg.is_capturing()))
        probe(x)
        seen.append(("graph", bg.is_capturing()))
    assert seen == [("graph", True), ("break", True), ("graph", True)]
    seen.clear()
    graph.replay()
    assert seen == [("break", False)]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_a_capture_stream_on_another_device_follows_and_joins_that_devices_current_stream():
    """With device 0 current and a capture stream of device 1, the capture orders itself
    after device 1's current stream (where the inputs were written) and that stream after
    the capture, not device 0's."""
    other = torch.device("cuda", 1)
    torch.cuda.set_device(0)
    x = torch.zeros(1 << 20, device=other)
    with torch.cuda.device(other):
        torch.cuda._sleep(200_000_000)  # the input is written late on device 1's current stream
        x.fill_(1.0)
    seen = []

    @bg.eager_on_graph
    def read_and_double(t):
        seen.append(t.sum().item())
        torch.cuda._sleep(200_000_000)
        return t * 2

    with bg.BreakableCUDAGraphCapture(bg.BreakableCUDAGraph(), stream=torch.cuda.Stream(other)):
        doubled = read_and_double(x)
    assert torch.cuda.current_device() == 0
    assert seen == [float(x.numel())]
    with torch.cuda.device(other):
        assert torch.equal(doubled, x * 2)  # on device 1's current stream, after the break
