"""The callable form on a GPU: replay returns the static output; BREAKGRAPH_DISABLE=1 runs it eagerly."""

import pytest
import torch

import breakgraph as bg
from tests.helpers import assert_close, poison_

DEV = "cuda"


@bg.eager_on_graph
def softmax_eager(x):
    return torch.softmax(x, dim=-1)


def test_graphed_callable_form():
    w = torch.randn(32, 32, device=DEV)

    def fn(x, *, bias):
        return softmax_eager(x @ w) + bias

    x, bias = torch.randn(8, 32, device=DEV), torch.randn(32, device=DEV)
    g = bg.graphed(fn, x, bias=bias)
    for _ in range(3):
        fresh = torch.randn_like(x)
        x.copy_(fresh)
        poison_(g.output)
        out = g.replay()
        assert out is g.output
        assert_close(out, fn(fresh, bias=bias), 1e-4, 1e-4)


def test_disable_env_runs_callable_eagerly_and_refuses_context(monkeypatch):
    monkeypatch.setenv("BREAKGRAPH_DISABLE", "1")
    calls = []

    def fn(x):
        calls.append(1)
        return softmax_eager(x) * 2

    x = torch.randn(4, 8, device=DEV)
    with pytest.warns(UserWarning, match="BREAKGRAPH_DISABLE"):
        g = bg.graphed(fn, x)
    assert g.eager and g.graph is None and len(calls) == 1
    for _ in range(2):
        fresh = torch.randn_like(x)
        x.copy_(fresh)
        out = g.replay()
        assert out is g.output  # one output object, refreshed in place, as when captured
        assert_close(out, torch.softmax(fresh, -1) * 2)
    assert len(calls) == 3
    with pytest.raises(RuntimeError, match="graphed"):
        with bg.BreakableCUDAGraphCapture(bg.BreakableCUDAGraph()):
            pass
