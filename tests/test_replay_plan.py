"""The replay plan's layout (CPU): launches ahead of the first Python step go first, and
autograd goes off just before that step; debug mode turns it off before anything."""

import torch

import breakgraph as bg
from breakgraph.graph import _autograd_off


class FakeSegment:
    def __init__(self, kind: str):
        self.kind = kind

        def launch(_stream):
            return None

        self.launch = launch

    def launcher(self):
        return self.launch


def planned(kinds, debug=False, before=None, after=None):
    graph = bg.BreakableCUDAGraph(debug=debug)
    graph._segments = tuple(FakeSegment(kind) for kind in kinds)
    graph.set_replay_hooks(before, after)
    graph._build_plan()
    return graph, [segment.launch for segment in graph._segments]


def test_autograd_goes_off_after_the_launches_ahead_of_the_first_break():
    graph, (forward, log, backward, clip, update) = planned(["graph", "eager", "graph", "eager", "graph"])
    assert graph._plan == (forward, _autograd_off, log, backward, clip, update)
    assert graph._segment_of_step[backward] == 2  # a launch error names its segment


def test_a_plan_without_python_never_turns_autograd_off():
    graph, launches = planned(["graph", "graph"])
    assert graph._plan == tuple(launches)


def test_hooks_run_with_autograd_off_too():
    graph, (first, second) = planned(["graph", "graph"], after=lambda: None)
    assert graph._plan[:3] == (first, second, _autograd_off) and len(graph._plan) == 4
    graph, (first, second) = planned(["graph", "eager"], before=lambda: None)
    assert graph._plan[0] is _autograd_off and graph._plan[2:] == (first, second)


def test_debug_mode_turns_autograd_off_before_its_checks():
    graph, _ = planned(["graph", "eager", "graph"], debug=True)
    assert graph._plan[0] is _autograd_off and _autograd_off not in graph._plan[1:]
    assert len(graph._plan) == 5  # the argument check, then the three checked launches


def test_the_step_turns_autograd_off():
    with torch.enable_grad():  # which sets the mode back as it exits
        _autograd_off(None)
        assert not torch.is_grad_enabled()
