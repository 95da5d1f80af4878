"""The op watch, without a GPU: both of its forms (the dispatch-key kernels and the
fallback ``TorchDispatchMode``) hand every random op to the capture, once, and only while a
segment records; every other op passes untouched, and nothing stays switched on after."""

import threading

import pytest
import torch
import torch.nn.functional as F

from breakgraph.base import context
from breakgraph.recording import op_watch
from tests.helpers import use_watch

RANDOM_CALLS = {
    "rand": lambda x: torch.rand(3),
    "randn": lambda x: torch.randn(2, 2),
    "rand_like": lambda x: torch.rand_like(x),
    "randint": lambda x: torch.randint(0, 5, (3,)),
    "randperm": lambda x: torch.randperm(5),
    "dropout": lambda x: F.dropout(x, 0.5, training=True),
    "bernoulli_": lambda x: x.clone().bernoulli_(0.5),
    "normal_": lambda x: x.clone().normal_(),
    "uniform_": lambda x: x.clone().uniform_(),
    "random_": lambda x: x.clone().random_(0, 9),
    "exponential_": lambda x: x.clone().exponential_(),
    "multinomial": lambda x: torch.multinomial(x.abs() + 0.1, 2),
}


class FakeCapture:
    """The watch's view of a capture: whether a segment records, and what it was handed."""

    def __init__(self, segment_open=True, body_depth=0):
        self.segment_open, self.body_depth = segment_open, body_depth
        self.handed: list[str] = []

    def random_op(self, op, call, args, kwargs):
        self.handed.append(str(op))
        return call(*args, **kwargs)


@pytest.fixture(params=["dispatch key", "dispatch mode"])
def watching(request, monkeypatch):
    """Enter the watch of a capture, in one form or the other, as the recorder does."""
    use_watch(monkeypatch, request.param)

    def enter(capture):
        token = context.activate(capture)
        watch = op_watch.watch_ops(capture)
        watch.__enter__()

        def leave():
            watch.__exit__(None, None, None)
            context.deactivate(token)

        return leave

    return enter


def test_this_torch_lends_the_watch_its_dispatch_key():
    assert op_watch._key_watch.available()


@pytest.mark.parametrize("name", sorted(RANDOM_CALLS))
def test_each_random_op_is_handed_to_the_capture_once_and_runs(watching, name):
    x = torch.rand(8)
    capture = FakeCapture()
    leave = watching(capture)
    try:
        result = RANDOM_CALLS[name](x)
    finally:
        leave()
    (handed,) = capture.handed  # dropout's composite calls one random op: bernoulli_ on CPU tensors
    assert name.rstrip("_") in handed or (name == "dropout" and "bernoulli_" in handed)
    assert isinstance(result, torch.Tensor) and result.numel() > 0


def test_plain_ops_pass_untouched_and_a_random_ops_gradient_is_right(watching):
    x = torch.rand(16, requires_grad=True)
    capture = FakeCapture()
    leave = watching(capture)
    try:
        y = F.dropout(x * 2, 0.5, training=True).sum() + x.mean()
    finally:
        leave()
    y.backward()
    assert len(capture.handed) == 1
    kept = F.dropout(torch.ones(1), 0.0, training=True)  # nothing watched here any more
    assert kept.item() == 1.0 and len(capture.handed) == 1
    assert torch.all((x.grad == 1 / 16) | (x.grad == 4 + 1 / 16))


@pytest.mark.parametrize("where", ["in an eager break", "in a conditional body"])
def test_random_ops_outside_a_recording_segment_run_as_they_would_eagerly(watching, where):
    capture = FakeCapture(segment_open=where != "in an eager break", body_depth=int(where == "in a conditional body"))
    leave = watching(capture)
    try:
        drawn = torch.rand(4)
    finally:
        leave()
    assert capture.handed == [] and drawn.shape == (4,)


def test_a_capture_that_refuses_a_random_op_leaves_the_watch_off(watching):
    class Refusing(FakeCapture):
        def random_op(self, op, call, args, kwargs):
            raise RuntimeError(f"refused {op}")

    capture = Refusing()
    leave = watching(capture)
    try:
        with pytest.raises(RuntimeError, match="refused aten.rand"):
            torch.rand(2)
    finally:
        leave()
    after = FakeCapture()
    token = context.activate(after)
    try:
        torch.rand(2)  # the capture is active, the watch is not
    finally:
        context.deactivate(token)
    assert after.handed == []


_libraries = []  # keeps the op below defined for the process


def test_a_random_op_another_library_defines_after_the_first_capture_is_handed_to_the_capture(watching):
    op_watch._key_watch.available()  # what the process's first capture registers, before the op exists
    name = f"noisy{len(_libraries)}"  # one op for each form of the watch
    library = torch.library.Library("breakgraph_test", "FRAGMENT")
    library.define(f"{name}(Tensor x) -> Tensor", tags=(torch.Tag.nondeterministic_seeded,))
    library.impl(name, lambda x: x + torch.rand_like(x), "CompositeExplicitAutograd")
    _libraries.append(library)
    capture = FakeCapture()
    leave = watching(capture)
    try:
        noisy = getattr(torch.ops.breakgraph_test, name)(torch.zeros(4))
    finally:
        leave()
    assert capture.handed == [f"breakgraph_test.{name}.default"]  # once: its rand_like is part of it
    assert noisy.shape == (4,) and noisy.unique().numel() > 1


def test_an_op_defined_later_that_cannot_be_watched_leaves_the_watch_as_it_was(monkeypatch):
    assert op_watch._key_watch.available()

    def refuse(self, libraries, func):
        raise RuntimeError(f"cannot register {func}")

    monkeypatch.setattr(op_watch._KeyWatch, "_watch", refuse)
    library = torch.library.Library("breakgraph_test", "FRAGMENT")
    library.define("unwatchable(Tensor x) -> Tensor", tags=(torch.Tag.nondeterministic_seeded,))
    library.impl("unwatchable", lambda x: x + torch.rand_like(x), "CompositeExplicitAutograd")
    _libraries.append(library)
    assert op_watch._key_watch.available()  # the kernels registered before stay, the fallthrough too
    use_watch(monkeypatch, "dispatch key")
    capture = FakeCapture()
    token = context.activate(capture)
    try:
        with op_watch.watch_ops(capture):
            plain = torch.ones(2) * 3
            torch.rand(2)
    finally:
        context.deactivate(token)
    assert capture.handed == ["aten.rand.default"] and plain.tolist() == [3.0, 3.0]


def test_the_watch_is_this_threads_only(watching):
    capture = FakeCapture()
    leave = watching(capture)
    try:
        worker = threading.Thread(target=lambda: torch.rand(3))
        worker.start()
        worker.join()
        torch.rand(3)
    finally:
        leave()
    assert capture.handed == ["aten.rand.default"]


def test_code_torch_compile_compiled_runs_under_the_watch_without_compiling_again():
    """Dynamo's guards check the thread's dispatch keys: once it compiled code, the watch is the mode."""
    compiled = torch.compile(lambda x: x * 2 + 1, backend="eager")
    with torch.inference_mode():
        x = torch.ones(2)
        compiled(x)
        assert op_watch.dynamo_compiled()
        capture = FakeCapture()
        token = context.activate(capture)
        try:
            with torch._dynamo.config.patch(error_on_recompile=True), op_watch.watch_ops(capture):
                assert torch.equal(compiled(x), x * 2 + 1)
                torch.rand(2)
        finally:
            context.deactivate(token)
    assert capture.handed == ["aten.rand.default"]
