"""Segments on their own: an eager break replays its function and writes back; a graph segment
launches its own executable or a shared one (executables faked, no GPU)."""

import pytest
from cuda.bindings import runtime as cudart

import breakgraph_bindings as bindings
from breakgraph.segments import EagerSegment, GraphSegment, SharedExecutable

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

    segment = EagerSegment(0, "attention", lambda x, scale: calls.append((x, scale)) or x * scale, (3,), {"scale": 2}, 6, write)
    launch = segment.launcher()
    assert launch(None) is None
    assert calls == [(3, 2)] and written == [6] and segment.bytes_written == 16
    segment.release()
    assert (segment.args, segment.kwargs, segment.result) == ((), {}, None)


def test_a_graph_segment_without_its_executable_says_to_restore_it():
    graph, executable = FakeGraph("g"), FakeExecutable()
    segment = GraphSegment(0, "graph start -> end", graph, executable, 3, executable_bytes=1024)
    segment.drop_executable()
    assert executable.destroyed and segment.executable is None and segment.executable_bytes == 0
    with pytest.raises(RuntimeError, match="graph start -> end: its executable was released; restore it first"):
        segment.launcher()
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
    segment = GraphSegment(1, "graph a -> b", FakeGraph("g"), own, 2)
    shared = SharedExecutable(common, holds=FakeGraph("other"))
    segment.share(shared)
    assert own.destroyed and segment.shared is shared
    segment.drop_executable()
    assert not common.destroyed and segment.shared is None
