"""The replay plan on CPU, with segments whose launches record themselves: the order of the
steps, where autograd goes off and comes back, writeback and launch errors, one function
per stream; debug mode's steps written from the same lines; a new kind of segment as one class."""

import gc
import linecache
import traceback
import weakref
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

import breakgraph_bindings as bindings
import breakgraph as bg
from breakgraph.graphs import debug as debug_mode
from breakgraph import diagnostics
from breakgraph.recording.breaks import EagerSegment
from breakgraph.graphs.plan import ReplayPlan
from breakgraph.recording.segments import GraphSegment, Segment, TorchGraphSegment
from breakgraph.recording.writeback import WritebackError, make_writer

CUDA_ERROR_INVALID_VALUE = 1


class Log(list):
    def step(self, name):
        self.append((name, torch.is_grad_enabled()))


class FakeGraphSegment(GraphSegment):
    """A segment launched through cuda.bindings, with its executable faked: its launch returns ``(status,)``."""

    def __init__(self, index, log, status=0):
        super().__init__(index, f"graph {index}", FakeGraph(), None, num_nodes=2)
        self.log, self.status, self.streams = log, status, []

    def launch_on(self, stream):
        def launch():
            self.streams.append(int(stream))
            self.log.step(self.name)
            return (self.status,)

        return launch

    def drop_executable(self):
        self.log.step(f"{self.name} dropped")


class FakeGraph:
    def to_dot(self, path):
        path.write_text("digraph {}\n")

    def destroy(self):
        pass


class FakeTorchGraph:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def replay(self):
        self.log.step(self.name)


def torch_segment(index, log):
    return TorchGraphSegment(index, f"torch {index}", None, FakeTorchGraph(f"torch {index}", log))


def eager_segment(index, log, captured=None, returns=None, kwargs=None):
    def function(*args, **kwargs):
        log.step(f"break {index}")
        return returns(*args, **kwargs) if returns else captured

    return EagerSegment(index, f"break {index}", function, (), kwargs or {}, make_writer(f"break {index}", captured), result=captured)


def replay(plan, stream=0x1234):
    """What ``BreakableCUDAGraph.replay`` does with its plan on ``stream``."""
    (plan.by_stream.get(stream) or plan.compile(stream))()


def test_graph_replay_runs_the_function_written_for_the_current_stream_and_none_of_a_plan_gone():
    log, current = Log(), [0x10]
    graph = bg.BreakableCUDAGraph()
    graph._segments = (FakeGraphSegment(0, log), eager_segment(1, log), FakeGraphSegment(2, log))
    graph._current_stream = lambda: current[0]  # what capture binds: torch's current stream
    graph._build_plan()
    graph.replay()
    current[0] = 0x20
    graph.replay()
    graph.replay()
    assert graph.segments[2].streams == [0x10, 0x20, 0x20] and set(graph._plan.by_stream) == {0x10, 0x20}
    hooks = []
    graph.set_replay_hooks(before=lambda: hooks.append("before"))  # a new plan, its functions written anew
    graph.replay()
    assert hooks == ["before"] and graph.segments[2].streams[-1] == 0x20
    graph.release_executables()
    del log[:]
    with pytest.raises(RuntimeError, match="released"):
        graph.replay()
    assert log == []  # nothing launched: the functions of the plan before went with it


def test_a_dropped_graph_lets_its_segments_go_before_its_pool():
    """Segments torch captured hold the pool in torch's allocator: a pool that died first would
    keep its memory until the next capture start, not give it back at the drop."""
    log = Log()

    class Pool:
        def __del__(self):
            log.step("pool")

    class DyingTorchGraph(FakeTorchGraph):
        def __del__(self):
            log.step(self.name)

    graph = bg.BreakableCUDAGraph()
    graph._segments = (TorchGraphSegment(0, "torch 0", None, DyingTorchGraph("segment", log)),)
    graph._pool = Pool()
    graph._current_stream = lambda: 0x10
    graph._build_plan()  # the plan and its replay functions hold the segments too
    graph.replay()
    del graph
    assert [name for name, _grad in log[-2:]] == ["segment", "pool"]


def test_replay_before_capture_says_so_without_asking_cuda_for_a_stream():
    with pytest.raises(RuntimeError, match="holds no capture"):
        bg.BreakableCUDAGraph().replay()


def test_launches_ahead_of_the_first_break_keep_the_callers_mode_then_autograd_is_off_until_the_end():
    log = Log()
    segments = [torch_segment(0, log), eager_segment(1, log), FakeGraphSegment(2, log), eager_segment(3, log, 2.5), FakeGraphSegment(4, log)]
    with torch.enable_grad():
        replay(ReplayPlan(segments))
        assert torch.is_grad_enabled()
    assert log == [("torch 0", True), ("break 1", False), ("graph 2", False), ("break 3", False), ("graph 4", False)]


def test_a_plan_of_launches_alone_leaves_autograd_as_it_is():
    log = Log()
    with torch.enable_grad():
        replay(ReplayPlan([FakeGraphSegment(0, log), torch_segment(1, log)]))
    assert log == [("graph 0", True), ("torch 1", True)]


@pytest.mark.parametrize("caller_autocast", [True, False])
def test_breaks_run_with_cuda_autocast_off_and_the_callers_autocast_comes_back_raising_or_not(caller_autocast):
    """torch on CPU switches CUDA autocast's state (not its context manager): the plan's own calls run."""
    seen = []

    def fails():
        raise ValueError("the break failed")

    def leaves_autocast_on():
        torch.set_autocast_enabled("cuda", True)  # a break that forgets to turn it off again

    def record(index, returns=None):
        def function():
            seen.append((index, torch.is_autocast_enabled("cuda")))
            return returns() if returns else None

        return EagerSegment(index, f"break {index}", function, (), {}, make_writer(f"break {index}", None))

    torch.set_autocast_enabled("cuda", caller_autocast)
    try:
        replay(ReplayPlan([record(0), record(1)]))
        assert seen == [(0, False), (1, False)] and torch.is_autocast_enabled("cuda") is caller_autocast
        with pytest.raises(ValueError, match="the break failed"):
            replay(ReplayPlan([record(2, returns=fails)]))
        assert seen[-1] == (2, False) and torch.is_autocast_enabled("cuda") is caller_autocast
        replay(ReplayPlan([record(3, returns=leaves_autocast_on)]))
        assert torch.is_autocast_enabled("cuda") is caller_autocast
    finally:
        torch.set_autocast_enabled("cuda", False)


def test_hooks_run_with_autograd_off_around_the_segments():
    log = Log()
    plan = ReplayPlan([FakeGraphSegment(0, log)], before=lambda: log.step("before"), after=lambda: log.step("after"))
    with torch.enable_grad():
        replay(plan)
    assert log == [("before", False), ("graph 0", False), ("after", False)]


def test_the_callers_mode_comes_back_when_a_break_raises_and_the_traceback_shows_the_step():
    def fails():
        raise ValueError("the break failed")

    log = Log()
    plan = ReplayPlan([FakeGraphSegment(0, log), eager_segment(1, log, returns=fails), FakeGraphSegment(2, log)])
    with torch.enable_grad():
        with pytest.raises(ValueError, match="the break failed") as raised:
            replay(plan)
        assert torch.is_grad_enabled()
    assert log == [("graph 0", True), ("break 1", False)]  # the launch after it never ran
    assert "function_1(*args_1)" in "".join(traceback.format_tb(raised.tb))


def test_a_failed_launch_names_its_segment_and_stops_the_replay():
    log = Log()
    plan = ReplayPlan([FakeGraphSegment(0, log), FakeGraphSegment(1, log, CUDA_ERROR_INVALID_VALUE), eager_segment(2, log)])
    with pytest.raises(bindings.CudaError, match=r"cudaGraphLaunch.*segment 1 \(graph: graph 1\)"):
        replay(plan)
    assert [name for name, _ in log] == ["graph 0", "graph 1"]


def test_each_stream_gets_its_own_function_bound_to_its_handle():
    log = Log()
    segment = FakeGraphSegment(0, log)
    plan = ReplayPlan([segment])
    replay(plan, 0x10)
    replay(plan, 0x20)
    replay(plan, 0x10)
    assert segment.streams == [0x10, 0x20, 0x10] and set(plan.by_stream) == {0x10, 0x20}


def test_a_result_without_buffers_is_checked_by_type_and_a_tensor_is_written_back():
    log = Log()
    captured = torch.zeros(3)
    value = eager_segment(0, log, 1.5, returns=lambda: 2.5)
    tensor = eager_segment(1, log, captured, returns=lambda scale: torch.full((3,), scale), kwargs={"scale": 4.0})
    replay(ReplayPlan([value, tensor]))
    assert torch.equal(captured, torch.full((3,), 4.0)) and tensor.bytes_written == 12 and value.bytes_written == 0

    wrong = eager_segment(0, log, 1.5, returns=lambda: torch.ones(1))
    with pytest.raises(WritebackError, match="type float at capture, Tensor at replay"):
        replay(ReplayPlan([wrong]))
    nothing = eager_segment(0, log, None, returns=lambda: 3)
    with pytest.raises(WritebackError, match="None at capture, int at replay"):
        replay(ReplayPlan([nothing]))


def test_debug_mode_turns_autograd_off_before_its_checks(monkeypatch):
    log = Log()
    monkeypatch.setattr(debug_mode.bindings, "synchronize", lambda stream: log.step("synchronize"))
    segments = [FakeGraphSegment(0, log), eager_segment(1, log)]
    with torch.enable_grad():
        replay(ReplayPlan(segments, debug=True))
    assert log == [("graph 0", False), ("synchronize", False), ("break 1", False), ("synchronize", False)]


def test_a_dropped_plan_goes_at_once_without_the_garbage_collector():
    """A graph's memory goes back as the graph is dropped only if its plan and what the plan's
    functions hold (the torch graphs) go at once: a cycle among them waits for the collector."""
    log = Log()
    segment = torch_segment(0, log)
    plan = ReplayPlan([segment, eager_segment(1, log, 2.0), FakeGraphSegment(2, log)])
    replay(plan)
    dropped = [weakref.ref(plan), weakref.ref(segment.capture)]
    sources = [name for name in linecache.cache if name.startswith(f"<breakgraph replay {id(plan):#x} ")]
    gc.disable()
    try:
        del plan, segment
        assert [ref() for ref in dropped] == [None, None]
    finally:
        gc.enable()
    assert len(sources) == 1 and sources[0] not in linecache.cache  # its source went with it


@pytest.mark.parametrize("debug", [False, True])
def test_a_dropped_graph_and_its_compiled_plan_go_at_once_without_the_garbage_collector(debug):
    log = Log()
    graph = bg.BreakableCUDAGraph(debug=debug)
    graph._segments = (torch_segment(0, log), FakeGraphSegment(1, log))
    graph._build_plan()
    graph._plan.compile(0x10)
    dropped = weakref.ref(graph)
    gc.disable()
    try:
        del graph
        assert dropped() is None
    finally:
        gc.enable()


def synchronize_logged(monkeypatch, log):
    monkeypatch.setattr(debug_mode.bindings, "synchronize", lambda stream: log.step("synchronize"))


def test_a_break_replays_alike_in_the_plans_function_and_in_debug_modes_steps(monkeypatch):
    synchronize_logged(monkeypatch, Log())
    for debug in (False, True):
        log, captured = Log(), torch.zeros(3)
        segment = eager_segment(0, log, captured, returns=lambda scale: torch.full((3,), scale), kwargs={"scale": 4.0})
        replay(ReplayPlan([segment], debug=debug))
        assert torch.equal(captured, torch.full((3,), 4.0)) and segment.bytes_written == 12
    errors = []
    for debug in (False, True):
        wrong = eager_segment(0, Log(), 1.5, returns=lambda: torch.ones(1))
        with pytest.raises(WritebackError, match="type float at capture, Tensor at replay") as raised:
            replay(ReplayPlan([wrong], debug=debug))
        errors.append(str(raised.value))
    assert errors[0] == errors[1]


def test_debug_modes_steps_are_the_lines_of_the_replay_function():
    log = Log()
    plan = ReplayPlan([FakeGraphSegment(0, log), eager_segment(1, log, torch.zeros(1)), eager_segment(2, log, 2.5), torch_segment(3, log)])
    replay(plan, 0x10)
    steps = plan.step_functions(0x10)
    assert len(steps) == 4

    def source(what):
        (lines,) = [linecache.getlines(name) for name in linecache.cache if name.startswith(f"<breakgraph {what} {id(plan):#x} ")]
        return [line.strip() for line in lines if not line.startswith("def ")]

    replay_lines = iter(source("replay"))
    assert all(line in replay_lines for line in source("steps"))  # every step's lines, in the same order
    del log[:]
    for step in steps:
        step()
    assert [name for name, _ in log] == ["graph 0", "break 1", "break 2", "torch 3"]


def test_a_failed_launch_in_debug_mode_names_its_segment(monkeypatch):
    log = Log()
    synchronize_logged(monkeypatch, log)
    plan = ReplayPlan([FakeGraphSegment(0, log, CUDA_ERROR_INVALID_VALUE), eager_segment(1, log)], debug=True)
    with pytest.raises(bg.SegmentError, match=r"segment 0 \(graph: graph 0\) failed: cudaGraphLaunch") as raised:
        replay(plan)
    assert str(raised.value).count("graph 0") == 1, raised.value
    assert [name for name, _ in log] == ["graph 0"]


@dataclass(eq=False)
class HostCallback(Segment):
    """A kind of segment breakgraph does not have, written as one class: a callback on the host."""

    kind = "callback"
    callback: Callable[[], None]

    def emit(self, source):
        source.python(f"{source.bind('callback', self.callback)}()")


def test_a_new_kind_of_segment_is_one_class(monkeypatch, tmp_path):
    log = Log()
    synchronize_logged(monkeypatch, log)
    graph = bg.BreakableCUDAGraph()
    graph._segments = (FakeGraphSegment(0, log), HostCallback(1, "notify", lambda: log.step("callback")), eager_segment(2, log))
    graph._current_stream = lambda: 0x10
    graph._build_plan()
    with torch.enable_grad():
        graph.replay()
    assert log == [("graph 0", True), ("callback", False), ("break 2", False)]
    del log[:]
    graph.debug = True
    graph.replay()
    assert [name for name, _ in log] == ["graph 0", "synchronize", "callback", "synchronize", "break 2", "synchronize"]
    assert (graph.num_graphs, graph.num_eager_breaks, graph.executable_bytes) == (1, 1, 0)
    rows = diagnostics.summary_rows(graph)
    assert [(row["kind"], row["nodes"], row["bytes_written"]) for row in rows] == [("graph", 2, ""), ("callback", 0, 0), ("eager", "", 0)]
    written = diagnostics.to_dot(graph, tmp_path, render=False)
    assert sorted(path.name for path in written) == ["overview.dot", "segment_0.dot"]
    assert 's1 [shape=ellipse, label="callback 1\\nnotify"];' in (tmp_path / "overview.dot").read_text()
    del log[:]
    graph.release_executables()
    assert log == [("graph 0 dropped", True)]
    graph.reset()
    assert graph.segments == ()


class RecordingOrdering:
    """A break's ordering whose steps record themselves."""

    runs_before = has_signals = True

    def __init__(self, log):
        self.log = log

    def before(self, stream):
        self.log.step(f"follow {int(stream):#x}")

    def after(self):
        self.log.step("signal")


def test_a_break_with_crossing_events_orders_its_streams_around_its_call():
    """The streams that follow the replay stream do so before the break's call, on the stream
    the replay runs on; the events later graphs wait on are recorded after it; in debug mode too."""
    log = Log()
    segment = eager_segment(1, log)
    segment.ordering = RecordingOrdering(log)
    plan = ReplayPlan((FakeGraphSegment(0, log), segment, FakeGraphSegment(2, log)))
    replay(plan, stream=0x99)
    assert [name for name, _grad in log] == ["graph 0", "follow 0x99", "break 1", "signal", "graph 2"]
    del log[:]
    for step in plan.step_functions(bindings.stream_handle(0x77)):
        step()
    assert [name for name, _grad in log] == ["graph 0", "follow 0x77", "break 1", "signal", "graph 2"]


class WritebackOrdering:
    """A break's ordering whose writeback waits for a side stream."""

    runs_before = has_signals = False
    orders_writeback = True

    def __init__(self, log):
        self.log = log

    def before_writeback(self, stream):
        self.log.step(f"join before writeback on {int(stream):#x}")

    def after_writeback(self, stream):
        self.log.step(f"fork after writeback on {int(stream):#x}")


def test_a_break_that_worked_on_a_side_stream_writes_its_result_back_between_the_join_and_the_fork():
    """Written back only after the join (the result may be that stream's work), then the stream
    waits for the copy; a break that writes nothing back has neither."""
    log = Log()
    captured = torch.zeros(3)

    def returns():
        log.step("break 1")
        return torch.full((3,), 2.0)

    writes = EagerSegment(1, "break 1", returns, (), {}, make_writer("break 1", captured), result=captured)
    writes.write = logged_writer(writes.write, log)
    nothing = eager_segment(2, log)
    writes.ordering = nothing.ordering = WritebackOrdering(log)
    plan = ReplayPlan((FakeGraphSegment(0, log), writes, nothing))
    replay(plan, stream=0x99)
    assert [name for name, _grad in log] == [
        "graph 0", "break 1", "join before writeback on 0x99", "write", "fork after writeback on 0x99", "break 2"
    ]
    assert torch.equal(captured, torch.full((3,), 2.0))


def logged_writer(write, log):
    def logged(result):
        log.step("write")
        return write(result)

    logged.result_type = write.result_type
    return logged
