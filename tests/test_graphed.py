"""The callable form without a GPU (or under BREAKGRAPH_DISABLE=1): eager on every replay, one warning."""

import warnings

import pytest
import torch

import breakgraph as bg
from breakgraph.runtime import cuda_available

no_gpu = pytest.mark.skipif(cuda_available(), reason="checks the no-GPU fallback")


@no_gpu
def test_graphed_runs_eagerly_with_one_warning():
    calls = []

    @bg.eager_on_graph
    def attention(q):
        return torch.softmax(q, -1)

    def fn(x):
        calls.append(1)
        return attention(x) * 2

    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g = bg.graphed(fn, x)
        for _ in range(3):
            fresh = torch.randn_like(x)
            x.copy_(fresh)
            torch.testing.assert_close(g.replay(), torch.softmax(fresh, -1) * 2)
    assert g.eager and len(calls) == 3
    assert len([w for w in caught if "breakgraph" in str(w.message)]) == 1


def test_disable_env_forces_eager(monkeypatch):
    monkeypatch.setenv("BREAKGRAPH_DISABLE", "1")
    with pytest.warns(UserWarning, match="BREAKGRAPH_DISABLE=1"):
        g = bg.graphed(lambda x: x + 1, torch.ones(2))
    assert g.eager and torch.equal(g.replay(), torch.full((2,), 2.0))
