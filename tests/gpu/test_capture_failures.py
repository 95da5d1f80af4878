"""A capture that fails leaves nothing behind, and what cannot be captured is refused clearly."""

import subprocess
import sys

import pytest
import torch

import breakgraph_bindings as bindings
import breakgraph as bg
from tests.helpers import check_against_eager, softmax_eager, use_watch

DEV = "cuda"


# -- failure paths ----------------------------------------------------------------------------


def _assert_clean_state(caller_stream):
    assert not bg.is_capturing()
    assert torch.cuda.current_stream() == caller_stream
    assert torch.cuda.Stream.__dict__["wait_stream"] is _ORIGINAL_WAIT_STREAM
    assert torch.cuda.Event.__dict__["record"] is _ORIGINAL_RECORD
    assert bindings.capture_status(torch.cuda.current_stream()) is bindings.CaptureStatus.NONE
    # The next capture works and matches eager.
    check_against_eager(lambda x: softmax_eager(x * 2) + 1, [torch.randn(4, 8, device=DEV)])


_ORIGINAL_WAIT_STREAM = torch.cuda.Stream.__dict__["wait_stream"]
_ORIGINAL_RECORD = torch.cuda.Event.__dict__["record"]


class Boom(Exception):
    pass


def _raise_in_body(x):
    x * 2  # captured work before the failure
    raise Boom("body")


def _raise_in_break(x):
    @bg.eager_on_graph
    def bad(t):
        raise Boom("break")

    return bad(x * 2)


def _raise_after_break(x):
    softmax_eager(x)
    raise Boom("after")


@pytest.mark.parametrize("body", [_raise_in_body, _raise_in_break, _raise_after_break])
def test_exception_in_capture_leaves_nothing_behind(body):
    caller = torch.cuda.current_stream()
    graph = bg.BreakableCUDAGraph()
    with pytest.raises(Boom):
        with bg.BreakableCUDAGraphCapture(graph):
            body(torch.randn(4, 8, device=DEV))
    assert not graph.captured and graph.segments == ()
    _assert_clean_state(caller)


def test_a_failed_capture_still_orders_the_callers_later_work_after_its_breaks():
    """A break ran eagerly on the capture stream before the block failed: the caller's stream
    waits for it, as after a capture that ends, so reading the break's output is safe."""
    x = torch.ones(1 << 20, device=DEV)

    @bg.eager_on_graph
    def slow_double(t):
        torch.cuda._sleep(200_000_000)  # long enough that an unordered read comes first
        return t * 2

    with pytest.raises(Boom):
        with bg.BreakableCUDAGraphCapture(bg.BreakableCUDAGraph()):
            doubled = slow_double(x)
            raise Boom("after the break")
    assert torch.equal(doubled, x * 2)


@pytest.mark.parametrize("which", ["begin", "end"])
def test_failure_at_segment_boundary_leaves_nothing_behind(monkeypatch, which):
    caller = torch.cuda.current_stream()
    real = getattr(bindings, f"{which}_capture")
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise bindings.CudaError(999, f"injected failure in {which}_capture")
        return real(*args, **kwargs)

    monkeypatch.setattr(bindings, f"{which}_capture", flaky)
    graph = bg.BreakableCUDAGraph()
    with pytest.raises(bindings.CudaError):
        with bg.BreakableCUDAGraphCapture(graph):
            x = torch.randn(4, 8, device=DEV)
            softmax_eager(x * 2)
            softmax_eager(x * 3)
    monkeypatch.undo()
    assert not graph.captured
    _assert_clean_state(caller)


@bg.eager_on_graph
def _row_sums(t):
    return t.sum(dim=-1)


_FIRST_MATMUL_IN_A_CAPTURE = """
import torch, breakgraph as bg
x = torch.randn(64, 64, device="cuda")
try:
    with bg.BreakableCUDAGraphCapture(bg.BreakableCUDAGraph()):
        y = x @ x
except bg.UncapturableOpError as error:
    print("refused:", error)
assert not bg.is_capturing()
x @ x  # the warm-up the error asks for
graph = bg.BreakableCUDAGraph()
with bg.BreakableCUDAGraphCapture(graph):
    y = x @ x
x.copy_(torch.randn_like(x))
y.fill_(float("nan"))
graph.replay()
torch.testing.assert_close(y, x @ x)
print("ok", flush=True)
"""


def test_cublas_first_use_in_a_capture_says_to_run_the_code_once_eagerly_first():
    """In a fresh process, where cuBLAS has no handle yet: its creation inside the capture is
    refused with the remedy, and once warmed up the same capture replays like eager."""
    done = subprocess.run([sys.executable, "-c", _FIRST_MATMUL_IN_A_CAPTURE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "refused: (<string>:6) is its library's first use in this thread" in done.stdout, done.stdout
    assert "Run the captured code once eagerly first" in done.stdout and done.stdout.strip().endswith("ok")


@pytest.mark.parametrize(
    "segment, boundary", [("ours", "break"), ("torchs", "break"), ("ours", "end"), ("torchs", "end"), ("ours", "random op")]
)
def test_a_fork_no_hook_saw_is_refused_where_its_segment_ends_saying_how_to_join_it(segment, boundary):
    caller = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    unseen = torch.Stream(stream_id=side.stream_id, device_index=side.device_index, device_type=side.device_type)

    def body(x):
        if segment == "torchs":
            x = x + torch.rand_like(x)  # torch records the segment from this random op on
        unseen.wait_stream(torch.accelerator.current_stream())  # the generic stream's own method: C code, no hook
        with torch.cuda.stream(side):
            y = x * 2
        if boundary == "break":
            return _row_sums(y)
        return y + torch.rand_like(y) if boundary == "random op" else y

    where = {"break": r"_row_sums\(\)", "end": "the capture's end", "random op": r"the random op aten\.rand_like\.default"}[boundary]
    graph, x = bg.BreakableCUDAGraph(), torch.randn(4, 8, device=DEV)  # drawn before: inside, torch would record from it
    with pytest.raises(bg.StreamJoinError, match=rf"^the segment before {where}.* cannot end: .* work\.wait\(\)"):
        with bg.BreakableCUDAGraphCapture(graph):
            body(x)
    assert not graph.captured
    assert bindings.capture_status(side) is bindings.CaptureStatus.NONE  # the side stream left the capture too
    _assert_clean_state(caller)

    def forked_and_joined_as_the_hooks_see(x):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y = x * 2
        torch.cuda.current_stream().wait_stream(side)
        return _row_sums(y)

    check_against_eager(forked_and_joined_as_the_hooks_see, [torch.randn(4, 8, device=DEV)])  # the same stream serves again


@pytest.mark.parametrize(
    "illegal, words",
    [
        (lambda x: x.sum().item(), "synchronizes"),
        (lambda x: torch.nonzero(x > 0), "nonzero"),
        (lambda x: torch.cuda.synchronize(), "cannot be captured"),
        (lambda x: print(x), "cannot be captured"),
    ],
)
@pytest.mark.parametrize("watch", ["dispatch key", "dispatch mode", "none"])
def test_capture_illegal_op_raises_clear_error(monkeypatch, illegal, words, watch):
    use_watch(monkeypatch, watch)
    options = {"random_ops": "error"} if watch == "none" else {}
    caller = torch.cuda.current_stream()
    graph = bg.BreakableCUDAGraph()
    x = torch.randn(4, 8, device=DEV)
    with pytest.raises(bg.UncapturableOpError) as info:
        with bg.BreakableCUDAGraphCapture(graph, **options):
            illegal(x * 2)
    message = str(info.value)
    assert words in message and "@breakgraph.eager_on_graph" in message
    _assert_clean_state(caller)


def test_illegal_op_inside_a_break_is_fine():
    @bg.eager_on_graph
    def count_positive(x, out):
        out.fill_(int((x > 0).sum().item()))
        return out

    def fn(x, out):
        return count_positive(x * 1.0, out) + 0

    graph, _ = check_against_eager(fn, [torch.randn(64, device=DEV), torch.zeros(1, device=DEV)])


def test_nested_capture_rejected():
    outer = bg.BreakableCUDAGraph()
    with pytest.raises(RuntimeError, match="nested"):
        with bg.BreakableCUDAGraphCapture(outer):
            with bg.BreakableCUDAGraphCapture(bg.BreakableCUDAGraph()):
                pass
    _assert_clean_state(torch.cuda.current_stream())


def test_default_stream_refused():
    with pytest.raises(ValueError, match="default CUDA stream"):
        with bg.BreakableCUDAGraphCapture(bg.BreakableCUDAGraph(), stream=torch.cuda.default_stream()):
            pass
    assert not bg.is_capturing()


def test_capture_begin_on_the_default_stream_refused():
    graph = bg.BreakableCUDAGraph()
    with torch.cuda.stream(torch.cuda.default_stream()):
        with pytest.raises(ValueError, match="default CUDA stream"):
            graph.capture_begin()
    assert not bg.is_capturing() and not graph.captured


def test_replay_before_capture_raises():
    with pytest.raises(RuntimeError, match="holds no capture"):
        bg.BreakableCUDAGraph().replay()


def test_capture_twice_without_reset_raises():
    graph = bg.BreakableCUDAGraph()
    with bg.BreakableCUDAGraphCapture(graph):
        torch.randn(2, device=DEV)
    with pytest.raises(RuntimeError, match="reset"):
        with bg.BreakableCUDAGraphCapture(graph):
            pass


def test_a_break_whose_error_the_body_catches_leaves_the_capture_whole():
    @bg.eager_on_graph
    def fused(t):
        raise Boom("no fused kernel for this shape")

    def fn(x):
        h = x * 2
        try:
            h = fused(h)
        except Boom:
            h = h + 1  # the fallback, captured: every replay runs it
        return softmax_eager(h) * 3

    graph, _ = check_against_eager(fn, [torch.randn(4, 8, device=DEV)])
    assert [segment.kind for segment in graph.segments].count("eager") == 1  # the softmax; the failed break is not replayed
    _assert_clean_state(torch.cuda.current_stream())
