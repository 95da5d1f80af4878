"""The segment table, DOT export and per-segment profiling on a GPU."""

import shutil
import subprocess

import pytest
import torch

import breakgraph as bg
from breakgraph import diagnostics
from tests.helpers import normalize, normalized_model as model

DEV = "cuda"


def test_summary_node_counts_equal_bindings():
    w, x = torch.randn(32, 32, device=DEV), torch.randn(8, 32, device=DEV)
    g = bg.graphed(model, x, w)
    g.replay()
    text = diagnostics.summary(g.graph)
    for segment in g.graph.segments:
        if segment.kind == "graph":
            assert segment.num_nodes == segment.graph.num_nodes > 0
            assert f"{segment.num_nodes}" in text
    assert "eager" in text and "normalize" in text and "bytes written back" in text


def test_to_dot_writes_files_graphviz_parses(tmp_path):
    w, x = torch.randn(32, 32, device=DEV), torch.randn(8, 32, device=DEV)
    g = bg.graphed(model, x, w)
    paths = diagnostics.to_dot(g.graph, tmp_path, render=False)
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
    # Segments of about 0.2 ms of GPU work each, so that the event recorded after every
    # segment (a few µs of host time on a slow CPU) stays small beside what it times.
    w = torch.randn(1024, 1024, device=DEV)
    x = torch.randn(4096, 1024, device=DEV)

    def heavy(x, w):
        for _ in range(4):
            x = normalize(torch.relu(x @ w))
        return x

    g = bg.graphed(heavy, x, w)
    rows = diagnostics.profile(g.graph, iters=30)
    print(diagnostics.format_profile(rows))
    # medians: an eager break's mean takes in the host's outliers (p99 ten times p50 on a busy host)
    segment_total_ms = sum(row["p50_us"] for row in rows) / 1000
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
    assert diagnostics.plot_profile(rows, tmp_path / "profile.png").stat().st_size > 0
