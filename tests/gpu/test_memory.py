"""Graph memory an engine can plan around: shared executables, the estimate, release and restore,
every replay checked against eager (or, after a restore, bit for bit against before)."""

import functools

import pytest
import torch
from hypothesis import given, settings, strategies as st

import breakgraph as bg
import breakgraph_bindings as bindings
from breakgraph.demo import TinyTransformer
from tests.helpers import assert_close, normalize, normalized_model, poison_

DEV = "cuda"
SIZES = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


def _model(dim=64, heads=4):
    torch.manual_seed(0)
    return TinyTransformer(dim=dim, heads=heads, layers=2).to(DEV).eval()


def _runner(model, seq=8, dim=64, **options):
    static = torch.zeros(max(SIZES), seq, dim, device=DEV)
    return bg.GraphRunner(model, static, SIZES, progress=False, **options)


@functools.cache
def _shared_runner():
    model = _model()
    with torch.no_grad():
        return model, _runner(model, share_executables=True, measure_memory=True).capture()


@torch.no_grad()
@settings(max_examples=10, deadline=None)
@given(st.lists(st.integers(1, max(SIZES)), min_size=4, max_size=16), st.integers(0, 2**16))
def test_shared_executables_serve_every_size_like_eager_in_any_order(batch_sizes, seed):
    model, runner = _shared_runner()
    generator = torch.Generator(device=DEV).manual_seed(seed)
    for n in batch_sizes:
        x = torch.randn(n, 8, 64, device=DEV, generator=generator)
        assert_close(runner(x), model(x), 1e-4, 1e-4)


@torch.no_grad()
def test_sharing_keeps_one_executable_per_segment_and_topology():
    model, shared = _shared_runner()
    own = _runner(model, measure_memory=True).capture()
    segments = [s for graph in shared.graphs.values() for s in graph.segments if s.kind == "graph"]
    owners = [s for s in segments if s.executable is not None]
    sharers = [s for s in segments if s.executable is None]
    assert sharers and all(s.shared is not None and s.executable_bytes == 0 for s in sharers)
    by_executable = {}
    for s in segments:  # every segment launching one executable has that executable's topology
        handle = s.shared.executable if s.shared is not None else s.executable
        by_executable.setdefault(id(handle), set()).add((s.index, s.num_nodes))
    assert len(by_executable) == len(owners) < len(segments)
    assert all(len(topology) == 1 for topology in by_executable.values())
    # A refused segment keeps an executable of its own (this small model may have none refused:
    # tests/test_sharing.py makes refusals on the CPU).
    for key_size, refused in shared.refusals.items():
        for refusal in refused:
            segment = shared.graphs[key_size].segments[refusal.segment]
            assert isinstance(refusal.reason, str) and refusal.reason and segment.executable is not None
    assert shared.memory()["executable_bytes"] <= own.memory()["executable_bytes"]
    report = shared.report(print_table=False)
    assert sum(row["shared_segments"] for row in report["rows"]) == len(owners) + len(sharers) - sum(
        1 for s in owners if s.shared is None
    )


def test_graphs_of_different_structure_keep_their_own_executables_and_replay_right():
    x = torch.randn(16, 64, device=DEV)
    w = torch.randn(64, 64, device=DEV) / 8
    graphs, outputs = [], []
    for body in (lambda: normalized_model(x, w), lambda: normalize(x @ w) * 2):
        graph = bg.BreakableCUDAGraph()
        with bg.BreakableCUDAGraphCapture(graph):
            outputs.append(body())
        graphs.append(graph)
    refusals = bg.share_executables(graphs)
    assert refusals and {r.reason for r in refusals} == {"different segments and breaks"}
    for _ in range(2):
        fresh = torch.randn_like(x)
        x.copy_(fresh)
        for out in outputs:
            poison_(out)
        graphs[1].replay()
        graphs[0].replay()
        assert_close(outputs[0], normalized_model(fresh, w), 1e-4, 1e-4)
        assert_close(outputs[1], normalize(fresh @ w) * 2, 1e-4, 1e-4)


@torch.no_grad()
def test_estimate_memory_is_within_ten_percent_of_what_the_graphs_hold():
    model = _model(dim=256, heads=8)
    runner = _runner(model, seq=32, dim=256, measure_memory=True)
    estimate = runner.estimate_memory()
    assert len(estimate.probed_sizes) == 5 and max(SIZES) in estimate.probed_sizes and 1 in estimate.probed_sizes
    runner.capture()
    measured = runner.memory()
    assert measured["total_bytes"] == measured["pool_bytes"] + measured["executable_bytes"] > 0
    assert abs(estimate.total_bytes / measured["total_bytes"] - 1) <= 0.10, (estimate, measured)
    with pytest.raises(RuntimeError, match="before capture"):
        runner.estimate_memory()


@torch.no_grad()
def test_a_runner_measures_executables_only_when_asked_and_its_estimate_always_does(capsys):
    model = _model()
    runner = _runner(model)
    estimate = runner.estimate_memory()  # its probes are measured whatever the runner says
    # (a count, maybe 0: the driver reuses executable memory earlier tests' graphs left it)
    assert len(estimate.probes) == 5 and all(isinstance(probe.executable_bytes, int) for probe in estimate.probes)
    runner.capture()
    held = runner.memory()
    assert held["pool_bytes"] > 0 and held["executable_bytes"] is None and held["total_bytes"] is None
    unmeasured = [size for (_key, size), graph in runner.graphs.items() if graph.executable_bytes is None]
    assert sorted(unmeasured) == sorted(set(SIZES) - set(estimate.probed_sizes))
    report = runner.report()
    assert {row["executable_kib"] for row in report["rows"] if row["size"] in unmeasured} == {""}
    assert "executables not measured" in capsys.readouterr().out
    for n in (1, 7, 64):  # unmeasured executables were not uploaded at capture: the first replay uploads them
        x = torch.randn(n, 8, 64, device=DEV)
        assert_close(runner(x), model(x), 1e-4, 1e-4)


@torch.no_grad()
def test_capture_after_an_estimate_that_probed_every_size_shares_the_executables():
    model = _model()
    runner = bg.GraphRunner(model, torch.zeros(8, 8, 64, device=DEV), [1, 2, 4, 8], share_executables=True, progress=False)
    assert sorted(runner.estimate_memory().probed_sizes) == [1, 2, 4, 8]  # capture() has no size left to capture
    runner.capture()
    segments = [s for graph in runner.graphs.values() for s in graph.segments if s.kind == "graph"]
    assert any(s.shared is not None for s in segments)
    for n in (1, 3, 8):
        x = torch.randn(n, 8, 64, device=DEV)
        assert_close(runner(x), model(x), 1e-4, 1e-4)


@torch.no_grad()
def test_a_released_runner_refuses_capture_and_reports_only_what_its_restore_captured():
    model = _model()
    runner = bg.GraphRunner(model, torch.zeros(8, 8, 64, device=DEV), [2, 4, 8], lazy=True, progress=False)
    x = torch.randn(3, 8, 64, device=DEV)
    runner(x)  # size 4, captured on first use
    (row,) = runner.report(print_table=False)["rows"]
    assert row["size"] == 4 and row["first_use_ms"] != ""
    runner.release()
    with pytest.raises(RuntimeError, match=r"released \(runner.release\(\)\): call runner.restore\(\) first"):
        runner.capture()
    runner.restore()
    (row,) = runner.report(print_table=False)["rows"]
    assert row["size"] == 4 and row["first_use_ms"] == ""  # captured by restore(), not on a first use
    assert_close(runner(x), model(x), 1e-4, 1e-4)


def _outputs(runner, inputs):
    return [runner(x).clone() for x in inputs]


@torch.no_grad()
@pytest.mark.parametrize("keep_graphs", [True, False])
def test_release_frees_memory_serves_eagerly_or_raises_and_restore_replays_bit_identically(keep_graphs):
    model = _model()
    runner = _runner(model).capture()
    inputs = [torch.randn(n, 8, 64, device=DEV) for n in (1, 5, 24, 64)]
    before = _outputs(runner, inputs)
    held = runner.memory()
    released = runner.release(keep_graphs=keep_graphs)
    if not keep_graphs:  # the pool comes back (the driver keeps executables' memory for later ones)
        assert released["freed_bytes"] >= 0.9 * held["pool_bytes"] > 0, (released, held)
    for x, expected in zip(inputs, before):
        assert_close(runner(x), expected, 1e-4, 1e-4)  # eagerly, while released
    with pytest.raises(RuntimeError, match="released already"):
        runner.release()
    restored = runner.restore()
    assert restored["seconds"] >= 0
    after = _outputs(runner, inputs)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    runner.release(keep_graphs=keep_graphs, while_released="raise")
    with pytest.raises(RuntimeError, match="call runner.restore"):
        runner(inputs[0])
    runner.restore()
    assert all(torch.equal(a, b) for a, b in zip(before, _outputs(runner, inputs)))
    with pytest.raises(RuntimeError, match="not released"):
        runner.restore()


def test_a_graph_releases_and_restores_its_executables_and_replays_the_same():
    x = torch.randn(16, 64, device=DEV)
    w = torch.randn(64, 64, device=DEV) / 8
    graph = bg.BreakableCUDAGraph()
    with bg.BreakableCUDAGraphCapture(graph, measure_memory=True):
        out = normalized_model(x, w)
    graph.replay()
    expected = out.clone()
    graph.release_executables()
    assert graph.captured and graph.executable_bytes == 0
    with pytest.raises(RuntimeError, match="restore_executables"):
        graph.replay()
    graph.restore_executables()
    poison_(out)
    graph.replay()
    assert torch.equal(out, expected)
    graph.release_executables()
    graph.reset()  # a released graph can be reset and captured again
    with bg.BreakableCUDAGraphCapture(graph):
        out = normalized_model(x, w)
    poison_(out)
    graph.replay()
    assert_close(out, normalized_model(x, w), 1e-4, 1e-4)


def test_executable_bytes_are_measured_per_segment_at_instantiation():
    torch.cuda.synchronize()
    free_before = bindings.free_device_memory()
    x = torch.randn(16, 64, device=DEV)
    w = torch.randn(64, 64, device=DEV) / 8
    graphs = []
    for _ in range(50):
        graph = bg.BreakableCUDAGraph(pool=graphs[0].pool if graphs else None)
        with bg.BreakableCUDAGraphCapture(graph, measure_memory=True):
            normalized_model(x, w)
        graphs.append(graph)
    measured = sum(graph.executable_bytes for graph in graphs)
    assert all(segment.executable_bytes >= 0 for graph in graphs for segment in graph.segments if segment.kind == "graph")
    assert measured <= free_before - bindings.free_device_memory()  # the pool is in the difference too


def test_executable_memory_is_measured_only_when_asked():
    x = torch.randn(16, 64, device=DEV)
    w = torch.randn(64, 64, device=DEV) / 8
    graph = bg.BreakableCUDAGraph()
    with bg.BreakableCUDAGraphCapture(graph):
        out = normalized_model(x, w)
    assert graph.executable_bytes is None
    assert all(segment.executable_bytes is None for segment in graph.segments if segment.kind == "graph")
    graph.release_executables()
    graph.restore_executables()  # restored unmeasured, as captured
    assert graph.executable_bytes is None
    poison_(out)
    graph.replay()
    assert_close(out, normalized_model(x, w), 1e-4, 1e-4)


def test_with_breakgraph_disabled_the_runner_estimates_nothing_and_releases_and_restores_eagerly(monkeypatch):
    """BREAKGRAPH_DISABLE=1 on a GPU: no graph will hold memory, so the estimate captures
    nothing and is zero; release and restore keep while_released's contract."""
    monkeypatch.setenv("BREAKGRAPH_DISABLE", "1")
    model = _model()
    with pytest.warns(UserWarning, match="BREAKGRAPH_DISABLE"):
        runner = _runner(model)
    estimate = runner.estimate_memory()
    assert (estimate.total_bytes, estimate.probed_sizes) == (0, ()) and runner.pool is None and not runner.graphs
    x = torch.randn(5, 8, 64, device=DEV)
    with torch.no_grad():
        expected = model(x)
        runner.release(while_released="raise")
        with pytest.raises(RuntimeError, match="released"):
            runner(x)
        assert runner.restore()["taken_bytes"] == 0 and runner.pool is None
        assert_close(runner(x), expected)
