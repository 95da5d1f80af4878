"""Sharing executables without a GPU: which refusals are recorded (executables faked, segments real)."""

import pytest
from cuda.bindings import runtime as cudart

import breakgraph as bg
import breakgraph_bindings as bindings
from breakgraph.recording.segments import GraphSegment
from breakgraph.graphs.sharing import Refusal

_UPDATE_FAILURE = int(cudart.cudaError_t.cudaErrorGraphExecUpdateFailure)


class _Executable:
    """Takes any captured graph's parameters but those of ``refuses``, for ``reason``."""

    def __init__(self, refuses=(), reason="ErrorTopologyChanged"):
        self.refuses = set(refuses)
        self.reason = reason
        self.destroyed = False

    def update(self, graph) -> None:
        if graph in self.refuses:
            raise bindings.GraphUpdateRefused(_UPDATE_FAILURE, "cudaGraphExecUpdate", "", self.reason)

    def destroy(self) -> None:
        self.destroyed = True


class _Graph(bg.BreakableCUDAGraph):
    """A captured breakable graph of one graph segment (its state set here, not by a capture)."""

    captured, released, segments = True, False, ()

    def __init__(self, name: str, executable: _Executable, num_nodes: int = 3):
        self.segments = (GraphSegment(0, f"graph of {name}", name, executable, num_nodes=num_nodes),)

    def rebuild_replay_plan(self) -> None:
        pass


def test_a_segment_refused_by_one_executable_that_joins_another_is_not_refused():
    first = _Graph("a", _Executable(refuses={"b", "c"}))
    second = _Graph("b", _Executable())
    third = _Graph("c", _Executable())
    refusals = bg.share_executables([first, second, third])
    # b: the only executable of its topology refused it, so it keeps its own; c: refused by a's, taken by b's
    assert refusals == [Refusal(1, 0, ("ErrorTopologyChanged",))]
    assert second.segments[0].executable is not None and second.segments[0].shared is not None
    assert third.segments[0].executable is None and third.segments[0].shared is second.segments[0].shared
    assert third.segments[0].shared.holds == "c"


def test_another_topology_is_not_a_refusal_and_each_reason_is_said_once():
    first = _Graph("a", _Executable(refuses={"c", "d"}))
    second = _Graph("b", _Executable(), num_nodes=5)  # another topology: its own executable, not refused
    third = _Graph("c", _Executable())
    fourth = _Graph("d", _Executable(refuses={"c"}))
    refusals = bg.share_executables([first, second, fourth, third])
    # d: refused by a's; c: refused by a's and by d's, for the same reason, said once
    assert refusals == [Refusal(2, 0, ("ErrorTopologyChanged",)), Refusal(3, 0, ("ErrorTopologyChanged",))]
    assert second.segments[0].executable is not None and second.segments[0].shared is None
    assert all(graph.segments[0].executable is not None for graph in (first, third, fourth))


def test_a_segment_every_executable_refuses_for_different_reasons_gets_each_reason():
    first = _Graph("a", _Executable(refuses={"b", "c"}))
    second = _Graph("b", _Executable(refuses={"c"}, reason="ErrorFunctionChanged"))
    third = _Graph("c", _Executable())
    refusals = bg.share_executables([first, second, third])
    assert refusals == [
        Refusal(1, 0, ("ErrorTopologyChanged",)),
        Refusal(2, 0, ("ErrorTopologyChanged", "ErrorFunctionChanged")),
    ]
    assert refusals[1].reason == "ErrorTopologyChanged, ErrorFunctionChanged"


def test_the_same_graph_twice_is_refused_before_anything_is_shared():
    first, second = _Graph("a", _Executable()), _Graph("b", _Executable())
    with pytest.raises(ValueError, match=r"the same graph twice \(items 0 and 2\)"):  # it would destroy what it launches
        bg.share_executables([first, second, first])
    assert all(graph.segments[0].shared is None and not graph.segments[0].executable.destroyed for graph in (first, second))
