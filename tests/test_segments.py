"""Segments on their own: an eager break replays its function and writes back; a graph segment
launches its own executable or a shared one (executables faked, no GPU); the interface's
defaults, which a kind overrides only where it differs."""

import pytest
from cuda.bindings import runtime as cudart

import breakgraph_bindings as bindings
from breakgraph.recording.breaks import EagerSegment
from breakgraph.graphs.plan import ReplayPlan
from breakgraph.recording.segments import GraphSegment, Segment, SharedExecutable

_REFUSED = int(cudart.cudaError_t.cudaErrorGraphExecUpdateFailure)


class FakeGraph:
    def __init__(self, name):
        self.name, self.destroyed = name, False

    def destroy(self):
        self.destroyed = True


class FakeExecutable:
    def __init__(self, refuses=()):
        self.refuses, self.holds, self.destroyed = set(refuses), None, False
        self.handle = 0

    def update(self, graph):
        if graph in self.refuses:
            raise bindings.GraphUpdateRefused(_REFUSED, "cudaGraphExecUpdate", "", "ErrorTopologyChanged")
        self.holds = graph

    def destroy(self):
        self.destroyed = True


def test_an_eager_segment_calls_its_function_and_writes_the_result_back():
    calls, written = [], []

    def write(result):
        written.append(result)
        return 16

    write.result_type = None  # a result with buffers: written back
    segment = EagerSegment(0, "attention", lambda x, scale: calls.append((x, scale)) or x * scale, (3,), {"scale": 2}, write, result=6)
    (step,) = ReplayPlan([segment]).step_functions(0)
    assert step() is None
    assert calls == [(3, 2)] and written == [6] and segment.bytes_written == 16
    segment.release()
    assert (segment.args, segment.kwargs, segment.result) == ((), {}, None)


def test_a_graph_segment_without_its_executable_says_to_restore_it():
    graph, executable = FakeGraph("g"), FakeExecutable()
    segment = GraphSegment(0, "graph start -> end", graph, executable, num_nodes=3, executable_bytes=1024)
    segment.drop_executable()
    assert executable.destroyed and segment.executable is None and segment.executable_bytes == 0
    with pytest.raises(RuntimeError, match="graph start -> end: its executable was released; restore it first"):
        ReplayPlan([segment]).step_functions(0)
    segment.release()
    assert graph.destroyed


def test_a_shared_executable_that_is_refused_goes_back_to_the_graph_it_held():
    first, second = FakeGraph("size 8"), FakeGraph("size 4")
    executable = FakeExecutable(refuses={second})
    shared = SharedExecutable(executable, holds=first)
    with pytest.raises(bindings.GraphUpdateRefused):
        shared.take(second)
    assert shared.holds is first and executable.holds is first
    third = FakeGraph("size 2")
    shared.take(third)
    assert shared.holds is third


def test_sharing_destroys_the_segments_own_executable_but_not_the_shared_one():
    own, common = FakeExecutable(), FakeExecutable()
    segment = GraphSegment(1, "graph a -> b", FakeGraph("g"), own, num_nodes=2)
    shared = SharedExecutable(common, holds=FakeGraph("other"))
    segment.share(shared)
    assert own.destroyed and segment.shared is shared
    segment.drop_executable()
    assert not common.destroyed and segment.shared is None


def test_a_shared_executable_launches_with_the_parameters_of_the_graph_it_launches_for(monkeypatch):
    launched = []
    monkeypatch.setattr("breakgraph.recording.segments._launch", lambda handle, stream: launched.append((handle, int(stream))) or (0,))
    first, second = FakeGraph("size 8"), FakeGraph("size 4")
    executable = FakeExecutable()
    shared = SharedExecutable(executable, holds=first)
    segment = GraphSegment(0, "graph start -> end", second, None)
    segment.share(shared)
    (step,) = ReplayPlan([segment]).step_functions(0x10)
    step()
    assert shared.holds is second and executable.holds is second and launched == [(0, 0x10)]


def test_the_interfaces_defaults_are_those_of_a_step_with_no_graph_and_no_executable():
    class Note(Segment):
        kind = "note"

        def emit(self, source):
            source.python("pass")

    note = Note(0, "a note")
    assert (note.num_nodes, note.executable_bytes, note.bytes_written, note.shared, note.result) == (0, 0, 0, None, None)
    assert note.describe() == "segment 0 (note: a note)" and note.table_cells() == {"nodes": 0, "bytes_written": 0}
    assert note.captured_anything() and not note.take_in(GraphSegment(0, "g", FakeGraph("g"), None))
    assert not note.has_own_executable and not note.write_dot(None)
    with pytest.raises(TypeError):
        Segment(0, "abstract")  # emit is what a kind must write
