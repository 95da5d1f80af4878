"""The random-op route on every torch from 2.8 to 2.14, without a GPU: a random op in a
segment makes the rest of it a capture torch begins (the one way torch 2.12 and later let a
capture draw random numbers), extra generators are registered where torch wants them, and
each version's refusal is recognised. CUDA and torch's graph are stood in for; the route
itself runs."""

import contextlib
import types

import pytest
import torch

from breakgraph.base import context
from breakgraph.recording import recorder, rng
from breakgraph.recording.dispatch import is_random_op_refusal
from breakgraph.base.options import CaptureOptions
from breakgraph.recording.streams import StreamJoinError

VERSIONS = ["2.8.0", "2.9.1", "2.10.0", "2.11.0+cu130", "2.12.0", "2.12.0.dev20260301+cu130", "2.13.0+cpu", "2.14.0", "2.14.1"]


@pytest.mark.parametrize(
    "version, explicitly",
    [
        ("2.8.0", True),
        ("2.11.0+cu130", True),
        ("2.12.0rc1", True),
        ("2.13.0+cpu", True),
        ("2.14.0", False),  # registers at the first draw, and warns on register_generator_state
        ("2.14.1", False),
        ("2.15.0.dev20261101+cu130", False),
        ("3.0.0", False),
    ],
)
def test_extra_generators_are_registered_before_torch_2_14_only(version, explicitly):
    assert rng.registers_generators_explicitly(version) is explicitly


@pytest.mark.parametrize(
    "message",
    [
        "Attempt to increase offset for a CUDA generator not in capture mode.",  # 2.8 to 2.11
        "RNG op during graph capture but generator is not registered with the capturing graph",  # 2.12, 2.13
        "RNG op during graph capture but could not find the CUDAGraph object",  # 2.14
    ],
)
def test_every_versions_refusal_of_a_random_op_is_recognised(message):
    assert is_random_op_refusal(RuntimeError(message))
    assert not is_random_op_refusal(RuntimeError("operation not permitted when stream is capturing"))
    assert not is_random_op_refusal(None)


class Log(list):
    """What the stand-ins for CUDA and torch's graph were asked to do, in order."""


class FakeGenerator(torch.Generator):
    """A generator that says it is CUDA's."""

    def __new__(cls, name):
        return super().__new__(cls)

    def __init__(self, name):
        super().__init__()
        self.name = name

    @property
    def device(self):
        return torch.device("cuda", 0)


class FakeTorchGraph:
    log: Log

    def __init__(self, keep_graph=False):
        assert keep_graph, "the route keeps torch's graph to count and print it"

    def register_generator_state(self, gen):
        self.log.append(("register", gen.name))

    def capture_begin(self, pool=None, capture_error_mode="global"):
        assert self.log.current is FakeStream.the, "torch begins its capture on the current stream: the capture stream"
        self.log.append(("torch capture_begin", pool, capture_error_mode))

    def capture_end(self):
        assert self.log.current is FakeStream.the, "torch ends its capture on the current stream: the capture stream"
        self.log.append("torch capture_end")

    def instantiate(self):
        self.log.append("torch instantiate")


class FakeStream:
    cuda_stream, device = 0x5, torch.device("cuda", 0)


FakeStream.the = FakeStream()


class FakeRawGraph:
    """A captured graph of ``num_nodes`` nodes; ``refuses`` makes it refuse a graph put in front."""

    def __init__(self, log=None, name="raw", num_nodes=3, refuses=False):
        self.log, self.name, self.num_nodes, self.refuses = log, name, num_nodes, refuses

    def prepend(self, front):
        if self.refuses:
            raise recorder.bindings.CudaError(1, "cudaGraphAddChildGraphNode")
        self.log.append(("prepend", front.name, "to", self.name))

    def instantiate(self):
        self.log.append(("instantiate", self.name))
        return types.SimpleNamespace(handle=0)

    def destroy(self):
        if self.log is not None:
            self.log.append(("destroy", self.name))


@pytest.fixture
def stand_ins(monkeypatch):
    """CUDA and torch's CUDA graph stood in for, logging what the capture asks of them."""
    log = Log()
    log.current = "a side stream"  # what the user's code made current

    @contextlib.contextmanager
    def on_stream(stream):
        previous, log.current = log.current, stream
        try:
            yield stream
        finally:
            log.current = previous

    monkeypatch.setattr(rng, "on_stream", on_stream)
    monkeypatch.setattr(FakeTorchGraph, "log", log, raising=False)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeTorchGraph)
    monkeypatch.setattr(torch.cuda, "default_generators", (FakeGenerator("default"),))
    monkeypatch.setattr(torch.cuda, "use_mem_pool", lambda pool, device: contextlib.nullcontext(log.append("route to pool")))
    monkeypatch.setattr(rng, "_known_pools", {})
    bindings = recorder.bindings
    monkeypatch.setattr(bindings, "begin_capture", lambda stream, mode: log.append("raw begin"))
    monkeypatch.setattr(bindings, "end_capture", lambda stream: log.append("raw end") or FakeRawGraph(log))
    monkeypatch.setattr(bindings, "discard_capture", lambda stream: log.append("raw discard"))
    return log


class FakePool:
    id = (0, 7)


@pytest.mark.parametrize("version", VERSIONS)
def test_a_random_op_in_a_segment_goes_on_in_a_capture_torch_begins_on_every_version(stand_ins, monkeypatch, version):
    monkeypatch.setattr(torch, "__version__", version)
    user = FakeGenerator("user's")
    options = CaptureOptions(generators=(user,), capture_error_mode="thread_local")
    active = recorder.start(FakePool(), FakeStream.the, options, record_addresses=False)
    try:
        torch.ones(4).add_(1)  # captured by cuda.bindings: the watch lets it through
        assert stand_ins[-1] == "raw begin"
        torch.rand(4)  # a random op: the segment ends here, and torch begins the next
        torch.rand(4)  # ...which goes on recording
    finally:
        active.abort()
    registered = [("register", "user's")] if rng.registers_generators_explicitly(version) else []
    assert stand_ins == [
        "route to pool",
        "raw begin",
        "raw end",
        # the pool's first torch capture: an empty one that keeps torch's host allocator knowing it
        ("torch capture_begin", (0, 7), "relaxed"),
        "torch capture_end",
        *registered,
        ("torch capture_begin", (0, 7), "thread_local"),
        "torch capture_end",  # the abort ends it
        ("destroy", "raw"),  # and destroys the raw segment
    ]


def test_with_random_ops_break_no_torch_capture_begins(stand_ins):
    active = recorder.start(FakePool(), FakeStream.the, CaptureOptions(random_ops="break"), record_addresses=False)
    try:
        torch.rand(4)
    finally:
        active.abort()
    assert not any(isinstance(entry, tuple) and entry[0] == "torch capture_begin" for entry in stand_ins)
    assert stand_ins[:4] == ["route to pool", "raw begin", "raw end", "raw begin"]  # the break between


def test_a_capture_told_its_function_draws_nothing_watches_no_op(stand_ins):
    with context.skip_op_watch():
        active = recorder.start(FakePool(), FakeStream.the, CaptureOptions(), record_addresses=False)
    try:
        torch.rand(4)  # unwatched: nothing splits (on a GPU, torch would refuse the op, and graphed captures again)
    finally:
        active.abort()
    assert stand_ins == ["route to pool", "raw begin", "raw discard"]


@pytest.mark.parametrize("refused", [False, True])
def test_the_segment_a_random_op_ended_is_launched_as_part_of_the_one_torch_records_from_that_op(stand_ins, monkeypatch, refused):
    monkeypatch.setattr(rng, "borrowed_graph", lambda graph: FakeRawGraph(stand_ins, "torch's", num_nodes=2, refuses=refused))
    active = recorder.start(FakePool(), FakeStream.the, CaptureOptions(), record_addresses=False)
    torch.ones(4).add_(1)
    torch.rand(4)  # the raw segment ends here; torch records from here on
    segments = active.finish().segments
    if refused:  # CUDA would not take the raw graph in: two launches, as captured
        assert [type(s).__name__ for s in segments] == ["GraphSegment", "TorchGraphSegment"]
        assert [s.index for s in segments] == [0, 1] and ("instantiate", "raw") in stand_ins
        return
    (only,) = segments
    assert type(only).__name__ == "TorchGraphSegment" and only.index == 0
    assert only.name == "graph start -> end" and only.num_nodes == 3 + 2
    assert stand_ins[-3:] == [("prepend", "raw", "to", "torch's"), ("destroy", "raw"), "torch instantiate"]


def test_a_segment_torch_could_not_end_keeps_its_generators_claimed_until_the_abort_lets_them_go(stand_ins, monkeypatch):
    refusals = iter([None, RuntimeError("CUDA error: capturing stream has unjoined work")])  # after the pool's first, empty one

    def capture_end(graph):
        stand_ins.append("torch capture_end")
        failure = next(refusals, None)
        if failure is not None:
            raise failure

    monkeypatch.setattr(FakeTorchGraph, "capture_end", capture_end)
    default = torch.cuda.default_generators[0]
    active = recorder.start(FakePool(), FakeStream.the, CaptureOptions(), record_addresses=False)
    try:
        torch.rand(4)  # torch records the segment from here on
        with pytest.raises(StreamJoinError, match="the segment before f\\(\\) cannot end"):
            active.run_break(lambda: None, (), {}, "f")
        assert id(default) in rng._held  # released once, by the abort: not here as well
    finally:
        active.abort()
    assert id(default) not in rng._held
