"""The public API on a machine without a GPU: decorators pass through, callable forms run eagerly."""

import os
import subprocess
import sys
import warnings

import pytest
import torch

import breakgraph as bg
from breakgraph.config import cuda_available

no_gpu = pytest.mark.skipif(cuda_available(), reason="checks the no-GPU fallback")


def test_decorator_passes_through_outside_capture():
    calls = []

    @bg.eager_on_graph
    def f(x, *, k=1):
        """doc"""
        calls.append((x, k))
        return x + k

    assert f(1, k=2) == 3 and calls == [(1, 2)]
    assert f.__name__ == "f" and f.__doc__ == "doc"


def test_decorator_enable_forms():
    def g(x):
        return x

    assert bg.eager_on_graph(enable=False)(g) is g
    wrapped = bg.eager_on_graph(enable=True)(g)
    assert wrapped is not g and wrapped(4) == 4


def test_bound_method_passthrough():
    class Layer:
        scale = 3

        @bg.eager_on_graph
        def run(self, x):
            return x * self.scale

    assert Layer().run(2) == 6


def test_break_graph_and_is_capturing_outside_capture():
    bg.break_graph()
    assert bg.is_capturing() is False


def test_public_names():
    for name in [
        "BreakableCUDAGraph",
        "BreakableCUDAGraphCapture",
        "GraphRunner",
        "break_graph",
        "eager_on_graph",
        "graphed",
        "is_capturing",
    ]:
        assert hasattr(bg, name)


def test_bad_capture_mode_is_rejected_before_anything_starts():
    with pytest.raises(ValueError, match="capture_error_mode"):
        bg.BreakableCUDAGraphCapture(bg.BreakableCUDAGraph(), capture_error_mode="strict")
    with pytest.raises(TypeError, match="BreakableCUDAGraph"):
        bg.BreakableCUDAGraphCapture(object())
    with pytest.raises(ValueError, match="'break' or 'error'"):
        bg.BreakableCUDAGraphCapture(bg.BreakableCUDAGraph(), random_ops="ignore")
    with pytest.raises(ValueError, match="'break' or 'error'"):
        bg.GraphRunner(lambda x: x, torch.zeros(4, 2), random_ops="skip")


@no_gpu
def test_context_form_without_cuda_points_to_callable_form():
    graph = bg.BreakableCUDAGraph()
    with pytest.raises(RuntimeError, match="graphed"):
        with bg.BreakableCUDAGraphCapture(graph):
            pass
    assert not bg.is_capturing() and not graph.captured


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


def test_disable_env_forces_eager_and_refuses_context(monkeypatch):
    monkeypatch.setenv("BREAKGRAPH_DISABLE", "1")
    with pytest.warns(UserWarning, match="BREAKGRAPH_DISABLE=1"):
        g = bg.graphed(lambda x: x + 1, torch.ones(2))
    assert g.eager and torch.equal(g.replay(), torch.full((2,), 2.0))
    with pytest.raises(RuntimeError, match="BREAKGRAPH_DISABLE"):
        with bg.BreakableCUDAGraphCapture(bg.BreakableCUDAGraph()):
            pass


def test_debug_env_switch(monkeypatch):
    from breakgraph.config import debug_requested

    monkeypatch.delenv("BREAKGRAPH_DEBUG", raising=False)
    assert debug_requested() is False and debug_requested(True) is True
    monkeypatch.setenv("BREAKGRAPH_DEBUG", "1")
    assert debug_requested() is True and debug_requested(False) is False
    assert bg.BreakableCUDAGraph().debug is True


@no_gpu
def test_demo_runs_the_eager_path_without_a_gpu():
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    run = subprocess.run(
        [sys.executable, "-m", "breakgraph", "demo", "--iters", "2"], capture_output=True, text=True, env=env, timeout=300
    )
    assert run.returncode == 0, run.stderr
    assert "no CUDA GPU" in run.stdout and "OK" in run.stdout


def test_import_without_gpu_in_a_fresh_process():
    run = subprocess.run([sys.executable, "-c", "import breakgraph; print('ok')"], capture_output=True, text=True)
    assert run.stdout.strip() == "ok", run.stderr
