"""Debug mode, the segment table, DOT export and per-segment profiling on a GPU."""

import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import breakgraph as bg
from breakgraph.debug import format_profile, plot_profile
from tests.helpers import assert_close, poison_

pytestmark = pytest.mark.gpu
DEV = "cuda"


@bg.eager_on_graph
def normalize(x):
    return x / x.norm(dim=-1, keepdim=True)


def model(x, w):
    h = torch.relu(x @ w)
    h = normalize(h)
    return normalize(h @ w) + 1


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


def test_summary_node_counts_equal_bindings():
    w, x = torch.randn(32, 32, device=DEV), torch.randn(8, 32, device=DEV)
    g = bg.graphed(model, x, w)
    g.replay()
    text = g.graph.summary()
    for segment in g.graph.segments:
        if segment.kind == "graph":
            assert segment.num_nodes == segment.graph.num_nodes > 0
            assert f"{segment.num_nodes}" in text
    assert "eager" in text and "normalize" in text and "bytes written back" in text


def test_to_dot_writes_files_graphviz_parses(tmp_path):
    w, x = torch.randn(32, 32, device=DEV), torch.randn(8, 32, device=DEV)
    g = bg.graphed(model, x, w)
    paths = g.graph.to_dot(tmp_path, render=False)
    dots = sorted(p.name for p in paths)
    assert dots == ["overview.dot", "segment_0.dot", "segment_2.dot", "segment_4.dot"]
    for path in paths:
        text = path.read_text()
        assert text.lstrip().startswith("digraph") and text.count("{") == text.count("}")
    dot = shutil.which("dot")
    if dot is not None:
        for path in paths:
            subprocess.run([dot, "-Tsvg", str(path), "-o", str(path.with_suffix(".svg"))], check=True)
        return
    # No Graphviz binary on this machine: parse with pydot, a full DOT-language parser.
    pydot = pytest.importorskip("pydot")
    for path in paths:
        parsed = pydot.graph_from_dot_file(str(path))
        assert parsed and parsed[0].get_type() == "digraph"
    segments = {f"segment_{s.index}.dot": s for s in g.graph.segments if s.kind == "graph"}
    for name, segment in segments.items():
        (parsed,) = pydot.graph_from_dot_file(str(tmp_path / name))
        nodes = [n for sub in [parsed, *parsed.get_subgraphs()] for n in sub.get_nodes() if n.get_name() not in ("node", "edge", "graph")]
        assert len(nodes) >= segment.num_nodes


def test_profile_sums_to_whole_replay_time(tmp_path):
    w = torch.randn(1024, 1024, device=DEV)
    x = torch.randn(512, 1024, device=DEV)

    def heavy(x, w):
        for _ in range(4):
            x = normalize(torch.relu(x @ w))
        return x

    g = bg.graphed(heavy, x, w)
    rows = g.graph.profile(iters=30)
    print(format_profile(rows))
    segment_total_ms = sum(row["mean_us"] for row in rows) / 1000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(30):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    whole_ms = sorted(times)[len(times) // 2]
    assert abs(segment_total_ms - whole_ms) <= 0.2 * whole_ms, (segment_total_ms, whole_ms)
    assert abs(sum(row["share"] for row in rows) - 1) < 0.01
    pytest.importorskip("matplotlib")
    assert plot_profile(rows, tmp_path / "profile.png").stat().st_size > 0
