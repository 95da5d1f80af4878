"""cond and while_loop off the GPU: Python if and while with the same checks, debug mode's
eager break, the refusals, and the driver version a conditional node needs."""

import threading
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import breakgraph as bg
import breakgraph_bindings as bindings
from breakgraph.base import context
from breakgraph.base.options import CaptureOptions
from breakgraph.recording import body_watch
from breakgraph.recording.recorder import Recorder


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.integers(-4, 4), min_size=1, max_size=6))
def test_cond_is_a_python_if_outside_a_capture(values):
    x = torch.tensor(values, dtype=torch.float32)
    out = bg.cond(x.sum() > 0, lambda a: (a * 2, {"n": a.norm()}), lambda a: (a - 1, {"n": a.sum()}), x)
    expected = (x * 2, {"n": x.norm()}) if sum(values) > 0 else (x - 1, {"n": x.sum()})
    torch.testing.assert_close(out[0], expected[0])
    torch.testing.assert_close(out[1]["n"], expected[1]["n"])


@settings(max_examples=60, deadline=None)
@given(limit=st.integers(0, 20), start=st.integers(-5, 5))
def test_while_loop_is_a_python_while_and_leaves_carried_as_it_was(limit, start):
    i, acc = torch.tensor(start), torch.zeros(3)
    final = bg.while_loop(lambda i, acc: i < limit, lambda i, acc: (i + 1, acc + i), (i, acc))
    steps = list(range(start, max(start, limit)))
    assert int(final[0]) == max(start, limit)
    torch.testing.assert_close(final[1], torch.full((3,), float(sum(steps))))
    assert int(i) == start and not acc.any()


def test_while_loop_works_on_its_own_copies_even_with_an_in_place_body():
    carried = (torch.tensor(0), torch.ones(3))

    def body(i, acc):
        acc.mul_(2)  # in place: on the loop's copy, never on the caller's tensor
        return i.add_(1), acc

    final = bg.while_loop(lambda i, acc: i < 3, body, carried)
    assert int(final[0]) == 3 and torch.equal(final[1], torch.full((3,), 8.0))
    assert int(carried[0]) == 0 and torch.equal(carried[1], torch.ones(3))
    untouched = bg.while_loop(lambda i, acc: i < 0, body, carried)  # no pass: copies all the same
    assert all(a is not b and torch.equal(a, b) for a, b in zip(untouched, carried))


@pytest.mark.parametrize(
    "pred, message",
    [
        (True, "got bool"),
        (torch.tensor([True, False]), "shape (2,)"),
        (torch.tensor(1.0), "torch.float32 tensor"),
    ],
)
def test_a_predicate_that_is_not_one_bool_on_a_tensor_is_refused(pred, message):
    with pytest.raises(TypeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        bg.cond(pred, lambda: 1, lambda: 2)


def test_functions_and_carried_of_the_wrong_kind_are_refused():
    with pytest.raises(TypeError, match="cond's false_fn must be a function, got int"):
        bg.cond(torch.tensor(True), lambda: 1, 2)
    with pytest.raises(TypeError, match="carried=...\\) takes a tuple of tensors, got list"):
        bg.while_loop(lambda i: i < 3, lambda i: (i + 1,), [torch.tensor(0)])
    with pytest.raises(TypeError, match="a tuple of Tensor, int"):
        bg.while_loop(lambda i, n: i < 3, lambda i, n: (i + 1, n), (torch.tensor(0), 3))
    with pytest.raises(TypeError, match="body_fn must return a tuple of 1 tensors, like carried; got Tensor"):
        bg.while_loop(lambda i: i < 3, lambda i: i + 1, (torch.tensor(0),))
    with pytest.raises(TypeError, match="cond_fn result must be a one-element torch.bool tensor"):
        bg.while_loop(lambda i: int(i) < 3, lambda i: (i + 1,), (torch.tensor(0),))


class _Capture:
    """A capture's interface as cond sees it, in debug mode: the call becomes an eager break."""

    segment_open, branches_on_device, body_depth = True, False, 0

    def __init__(self):
        self.breaks = []

    def run_break(self, function, args, kwargs, name, **_):
        self.breaks.append(name)
        return function(*args, **kwargs)


def test_debug_mode_makes_each_call_one_eager_break_that_runs_python():
    capture = _Capture()
    token = context.activate(capture)
    try:
        x = torch.tensor([1.0, -3.0])
        assert torch.equal(bg.cond(x.sum() > 0, lambda a: a, lambda a: -a, x), -x)
        (i,) = bg.while_loop(lambda i: i < 4, lambda i: (i + 1,), (torch.tensor(0),))
    finally:
        context.deactivate(token)
    assert capture.breaks == ["cond", "while_loop"] and int(i) == 4


def test_an_eager_break_inside_a_body_is_refused_with_the_way_out():
    stream = types.SimpleNamespace(cuda_stream=7)  # never captured on: the break is refused first
    recorder = Recorder(pool=None, stream=stream, options=CaptureOptions(), record_addresses=False)
    with recorder.inside_body(), pytest.raises(bg.UncapturableOpError, match="make the whole cond or while_loop an eager break"):
        recorder.run_break(print, (), {}, "attention")
    assert recorder.body_depth == 0


@pytest.mark.parametrize("kind, needs", [("IF", "12.3"), ("WHILE", "12.3"), ("IF_ELSE", "12.8")])
def test_a_driver_too_old_for_a_conditional_node_is_refused_naming_the_release(monkeypatch, kind, needs):
    monkeypatch.setattr(bindings.conditional, "driver_version", lambda: 12020)
    with pytest.raises(RuntimeError, match=f"needs a driver for CUDA {needs} or later.*this driver supports CUDA 12.2"):
        bindings.require_conditional_support(bindings.ConditionalKind[kind], "breakgraph.cond inside a capture")


def test_what_needs_the_host_is_named_before_cuda_sees_it():
    aten, gpu = torch.ops.aten, torch.device("cuda")
    x = torch.ones(3)
    assert "a copy between the host and the GPU" in body_watch.needs_the_host(aten._to_copy.default, (x,), {"device": gpu})
    assert body_watch.needs_the_host(aten._to_copy.default, (x,), {"dtype": torch.half}) is None
    assert body_watch.needs_the_host(aten.nonzero.default, (x,), {}) is None  # CPU tensors sync no GPU


def test_synchronize_is_refused_only_on_threads_capturing_a_body_and_restored_after_the_last():
    original = torch.cuda.synchronize
    inside, leave_first = threading.Event(), threading.Event()
    seen = {}

    class Watch:
        def refuse(self, what, fix):
            return bg.UncapturableOpError(what)

    def first():
        with body_watch.synchronize_refusal.during(Watch()):
            inside.set()
            leave_first.wait(10)

    thread = threading.Thread(target=first)
    thread.start()
    inside.wait(10)
    with body_watch.synchronize_refusal.during(Watch()):
        leave_first.set()
        thread.join(10)  # the first thread leaves while this one still captures
        try:
            torch.cuda.synchronize()
        except bg.UncapturableOpError as error:
            seen["refused"] = str(error)
    assert seen == {"refused": "torch.cuda.synchronize()"}
    assert torch.cuda.synchronize is original and torch.cuda.Stream.__dict__["synchronize"].__name__ == "synchronize"
