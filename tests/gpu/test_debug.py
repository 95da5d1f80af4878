"""Debug mode on a GPU: same results as normal mode, moved inputs named, failing segments named."""

import subprocess
import sys
import textwrap

import pytest
import torch

import breakgraph as bg
from tests.helpers import assert_close, normalized_model as model, poison_

DEV = "cuda"


def test_debug_mode_matches_normal_mode_and_eager():
    w = torch.randn(32, 32, device=DEV)
    x = torch.randn(8, 32, device=DEV)
    normal = bg.graphed(model, x, w)
    debug = bg.graphed(model, x, w, debug=True)
    assert debug.graph.num_graphs == 0 and debug.graph.num_eager_breaks == 1
    assert normal.graph.num_graphs == 3 and normal.graph.num_eager_breaks == 2
    for _ in range(3):
        fresh = torch.randn_like(x)
        x.copy_(fresh)
        poison_(normal.output), poison_(debug.output)
        a, b = normal.replay(), debug.replay()
        expected = model(fresh, w)
        assert_close(a, expected, 1e-4, 1e-4)
        assert_close(b, expected, 1e-4, 1e-4)


def test_env_var_turns_on_debug(monkeypatch):
    monkeypatch.setenv("BREAKGRAPH_DEBUG", "1")
    w, x = torch.randn(32, 32, device=DEV), torch.randn(8, 32, device=DEV)
    g = bg.graphed(model, x, w)
    assert g.debug and g.graph.debug and g.graph.num_eager_breaks == 1


def test_moved_input_is_named_in_debug_mode():
    w, x = torch.randn(32, 32, device=DEV), torch.randn(8, 32, device=DEV)
    g = bg.graphed(model, x, w, debug=True)
    g.replay()
    x.data = torch.randn_like(x)  # rebinding instead of x.copy_(...)
    with pytest.raises(bg.SegmentError, match=r"argument x: address 0x[0-9a-f]+ at capture, 0x[0-9a-f]+ at replay"):
        g.replay()


def test_out_of_bounds_kernel_is_named_by_segment():
    script = textwrap.dedent(
        """
        import torch, breakgraph as bg
        bad = {"on": False}

        @bg.eager_on_graph
        def gather_rows(x, index):
            if bad["on"]:
                index = index + 10_000_000
            return x[index]

        x = torch.randn(64, 8, device="cuda")
        index = torch.arange(4, device="cuda")
        graph = bg.BreakableCUDAGraph(debug=True)
        with bg.BreakableCUDAGraphCapture(graph):
            y = gather_rows(x * 2, index) + 1
        graph.replay()
        bad["on"] = True
        try:
            graph.replay()
        except bg.SegmentError as error:
            print("NAMED:", error)
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "NAMED: segment 1 (eager: " in run.stdout, run.stdout + run.stderr
    assert "gather_rows" in run.stdout


def test_a_freed_argument_is_named_before_anything_is_launched():
    ran = []

    @bg.eager_on_graph
    def first(t):
        ran.append("first")
        return t + 1

    x = torch.randn(1 << 16, device=DEV)  # the caller's tensor, outside the graph's pool
    graph = bg.BreakableCUDAGraph(debug=True)
    with bg.BreakableCUDAGraphCapture(graph):
        out = torch.relu(first(x)) * 2
    graph.replay()
    ran.clear()
    del x  # the graph keeps only a non-owning alias of it: its memory goes back to the allocator
    with pytest.raises(bg.SegmentError, match=r"first\(\) argument t: its memory \(0x[0-9a-f]+\) was freed since capture"):
        graph.replay()
    assert ran == []  # checked before the first segment ran
    assert out.shape == (1 << 16,)
