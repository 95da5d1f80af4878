"""Capture and replay on a real GPU: breaks anywhere, arguments of every shape, failures, threads, pools; all compared with eager."""

import gc
import threading
import weakref

import pytest
import torch

import breakgraph_bindings as bindings
import breakgraph as bg
from breakgraph.pool import PoolUsage
from breakgraph.runtime import claim_capture_stream, on_stream, run_on_stream
from tests.helpers import assert_close, check_against_eager, poison_

pytestmark = pytest.mark.gpu
DEV = "cuda"


@bg.eager_on_graph
def scale_eager(x, factor=2.0):
    return x * factor


@bg.eager_on_graph
def softmax_eager(x):
    return torch.softmax(x, dim=-1)


def test_break_in_the_middle():
    w = torch.randn(64, 64, device=DEV)

    def fn(x):
        y = torch.relu(x @ w)
        y = softmax_eager(y)
        return y @ w + 1

    graph, _ = check_against_eager(fn, [torch.randn(16, 64, device=DEV)])
    assert [s.kind for s in graph.segments] == ["graph", "eager", "graph"]
    assert graph.num_graphs == 2 and graph.num_eager_breaks == 1


def test_break_at_start_and_end():
    def fn(x):
        y = scale_eager(x)
        y = y.sin() * 3
        return softmax_eager(y)

    graph, _ = check_against_eager(fn, [torch.randn(8, 32, device=DEV)])
    assert [s.kind for s in graph.segments] == ["eager", "graph", "eager"]


def test_many_breaks():
    def fn(x):
        for i in range(40):
            x = x * 0.9 + i
            x = scale_eager(x, 1.01) if i % 2 else softmax_eager(x)
        return x

    graph, _ = check_against_eager(fn, [torch.randn(4, 16, device=DEV)], atol=1e-4, rtol=1e-4)
    assert graph.num_eager_breaks == 40
    assert graph.num_graphs == 40  # one segment after every break, none empty before the first


def test_consecutive_breaks_make_no_empty_segments():
    def fn(x):
        a = scale_eager(x)
        b = softmax_eager(a)
        bg.break_graph()
        return scale_eager(b, 3.0) + 1

    graph, _ = check_against_eager(fn, [torch.randn(4, 16, device=DEV)])
    assert [s.kind for s in graph.segments] == ["eager", "eager", "eager", "eager", "graph"]
    assert all(s.num_nodes > 0 for s in graph.segments if s.kind == "graph")


def test_enable_false_is_captured_in_the_graph():
    @bg.eager_on_graph(enable=False)
    def plain(x):
        return x + 1

    graph, _ = check_against_eager(lambda x: plain(x) * 2, [torch.randn(8, device=DEV)])
    assert graph.num_eager_breaks == 0 and graph.num_graphs == 1


def test_bound_methods():
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(32, 32, device=DEV)

        @bg.eager_on_graph
        def mix(self, x):
            return torch.cumsum(x, dim=-1) / x.shape[-1]

        def forward(self, x):
            return self.lin(self.mix(self.lin(x)))

    layer = Layer()
    graph, _ = check_against_eager(layer, [torch.randn(8, 32, device=DEV)], atol=1e-4, rtol=1e-4)
    assert graph.num_eager_breaks == 1


def test_kwargs_and_nested_container_args():
    @bg.eager_on_graph
    def combine(x, *, parts, weights):
        a, (b, c) = parts["a"], parts["rest"]
        return x * weights[0] + a - b * c * weights[1]

    def fn2(x, a, b, c):
        return combine(x + 1, parts={"a": a * 2, "rest": (b, c)}, weights=(0.5, 2.0)) * 3

    check_against_eager(fn2, [torch.randn(8, 8, device=DEV) for _ in range(4)])


def test_gemm_and_reductions_with_several_breaks():
    w1, w2 = torch.randn(128, 256, device=DEV) / 16, torch.randn(256, 128, device=DEV) / 16

    def fn(x):
        h = torch.relu(x @ w1)
        h = softmax_eager(h)
        m = h.mean(dim=0, keepdim=True)
        h = scale_eager(h - m)
        s = h.sum(dim=-1, keepdim=True)
        h = softmax_eager(h / (s.abs() + 1))
        return (h @ w2).norm(dim=-1)

    graph, _ = check_against_eager(fn, [torch.randn(32, 128, device=DEV)], atol=1e-4, rtol=1e-4)
    assert graph.num_eager_breaks == 3


def test_breaks_returning_non_tensors():
    seen = []

    @bg.eager_on_graph
    def count(x):
        seen.append(x.shape[0])
        return len(seen)

    @bg.eager_on_graph
    def note(x, label):
        return f"{label}:{x.dtype}"

    @bg.eager_on_graph
    def nothing(x):
        return None

    def fn(x):
        n = count(x)
        text = note(x, "t")
        nothing(x)
        return x * 2 + n, text

    graph = bg.BreakableCUDAGraph()
    x = torch.randn(4, device=DEV)
    with bg.BreakableCUDAGraphCapture(graph):
        out, text = fn(x)
    assert text == "t:torch.float32" and graph.num_eager_breaks == 3
    for _ in range(2):
        fresh = torch.randn_like(x)
        x.copy_(fresh)
        poison_(out)
        graph.replay()
        # n was 1 at capture: the graph keeps the captured scalar, the break still runs.
        assert_close(out, fresh * 2 + 1)
    assert len(seen) == 3


def test_deep_call_stack():
    def descend(x, depth):
        if depth == 0:
            return softmax_eager(x)
        return descend(x + 0.01, depth - 1) * 1.0

    check_against_eager(lambda x: descend(x, 60), [torch.randn(4, 8, device=DEV)], atol=1e-4, rtol=1e-4)


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


@pytest.mark.parametrize(
    "illegal, words",
    [
        (lambda x: x.sum().item(), "synchronizes"),
        (lambda x: torch.nonzero(x > 0), "nonzero"),
        (lambda x: torch.cuda.synchronize(), "cannot be captured"),
        (lambda x: print(x), "cannot be captured"),
    ],
)
def test_capture_illegal_op_raises_clear_error(illegal, words):
    caller = torch.cuda.current_stream()
    graph = bg.BreakableCUDAGraph()
    with pytest.raises(bg.UncapturableOpError) as info:
        with bg.BreakableCUDAGraphCapture(graph):
            x = torch.randn(4, 8, device=DEV) * 2
            illegal(x)
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


def test_on_stream_sets_and_restores_the_current_stream_as_torch_does():
    caller, side = torch.cuda.current_stream(), torch.cuda.Stream()
    with on_stream(side) as current:
        assert current is side and torch.cuda.current_stream() == side
        with on_stream(caller):
            assert torch.cuda.current_stream() == caller
        assert torch.cuda.current_stream() == side
    assert torch.cuda.current_stream() == caller
    with pytest.raises(Boom):
        with on_stream(side):
            raise Boom("inside")
    assert torch.cuda.current_stream() == caller and torch.cuda.current_device() == side.device_index


def test_capture_error_modes():
    for mode in ("global", "thread_local", "relaxed"):
        check_against_eager(lambda x: softmax_eager(x) * 2, [torch.randn(4, 8, device=DEV)], capture_error_mode=mode)
    with pytest.raises(ValueError, match="capture_error_mode"):
        bg.BreakableCUDAGraphCapture(bg.BreakableCUDAGraph(), capture_error_mode="loose")


@pytest.mark.parametrize("mode", ["global", "thread_local"])
def test_capture_follows_the_callers_pending_work(mode):
    x = torch.zeros(1 << 16, device=DEV)
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # keep the caller's stream busy
    x.fill_(3.0)  # still pending when the capture starts
    seen = {}

    @bg.eager_on_graph
    def read(t):
        seen["value"] = t.max().item()  # a host sync: fine inside a break
        return t * 2

    graph = bg.BreakableCUDAGraph()
    with bg.BreakableCUDAGraphCapture(graph, capture_error_mode=mode):
        out = read(x) + 1
    assert seen["value"] == 3.0, "the break ran before the caller's pending work"
    x.fill_(5.0)
    poison_(out)
    graph.replay()
    assert_close(out, torch.full_like(x, 11.0))


def test_is_capturing_in_graph_and_eager_parts_not_on_replay():
    seen = []

    @bg.eager_on_graph
    def probe(x):
        seen.append(("break", bg.is_capturing()))
        return x + 1

    graph = bg.BreakableCUDAGraph()
    x = torch.randn(4, device=DEV)
    assert not bg.is_capturing()
    with bg.BreakableCUDAGraphCapture(graph):
        seen.append(("graph", bg.is_capturing()))
        probe(x)
        seen.append(("graph", bg.is_capturing()))
    assert seen == [("graph", True), ("break", True), ("graph", True)]
    seen.clear()
    graph.replay()
    assert seen == [("break", False)]


def test_pool_shared_within_and_across_graphs_and_kept_across_reset():
    first = bg.BreakableCUDAGraph()
    x = torch.randn(256, 256, device=DEV)
    with bg.BreakableCUDAGraphCapture(first):
        a = softmax_eager(x @ x) * 2
    pool = first.pool
    assert bg.pool_bytes(pool) > 0, "capture allocated nothing in the graph's pool"
    # Every segment's and every break's allocations live in the one pool.
    in_pool = lambda t: PoolUsage.of(pool).holds(t.data_ptr())
    assert in_pool(a) and in_pool(first.segments[1].result)

    second = bg.BreakableCUDAGraph(pool=first.pool)
    with bg.BreakableCUDAGraphCapture(second):
        b = scale_eager(a + 1) - 3
    assert second.pool is pool and in_pool(b)
    for _ in range(2):
        fresh = torch.randn_like(x)
        x.copy_(fresh)
        poison_(a), poison_(b)
        first.replay()
        second.replay()
        expected_a = torch.softmax(fresh @ fresh, -1) * 2
        assert_close(a, expected_a, 1e-4, 1e-4)
        assert_close(b, (expected_a + 1) * 2 - 3, 1e-4, 1e-4)

    first.reset()
    assert first.pool is pool and not first.captured
    with bg.BreakableCUDAGraphCapture(first):
        c = softmax_eager(x) + 1
    fresh = torch.randn_like(x)
    x.copy_(fresh)
    poison_(c)
    first.replay()
    assert_close(c, torch.softmax(fresh, -1) + 1)


def test_reset_and_recapture_many_times_does_not_grow_memory():
    graph = bg.BreakableCUDAGraph()
    x = torch.randn(64, 64, device=DEV)
    # Warm up on the capture stream: cuBLAS's handle and workspace are not the capture's to make.
    with claim_capture_stream(x.device) as stream:
        run_on_stream(stream, lambda: softmax_eager(x @ x))
    torch.cuda.synchronize()
    sizes = []
    for cycle in range(200):
        with bg.BreakableCUDAGraphCapture(graph):
            out = softmax_eager(x @ x) + 1
        graph.replay()
        del out
        graph.reset()
        if cycle in (20, 199):
            gc.collect()
            sizes.append((torch.cuda.memory_allocated(), bg.pool_bytes(graph.pool)))
    (allocated_early, pool_early), (allocated_late, pool_late) = sizes
    assert pool_late == pool_early and allocated_late <= allocated_early  # nothing grows


def test_break_arguments_are_not_kept_alive():
    graph = bg.BreakableCUDAGraph()
    x = torch.randn(1024, device=DEV)
    with bg.BreakableCUDAGraphCapture(graph):
        temp = x * 2
        ref = weakref.ref(temp)
        out = scale_eager(temp, factor=3.0) + 1
        del temp
    gc.collect()
    assert ref() is None, "the break's argument was kept alive by the graph"
    fresh = torch.randn_like(x)
    x.copy_(fresh)
    poison_(out)
    graph.replay()
    assert_close(out, fresh * 6 + 1)


def test_break_results_are_not_kept_alive_and_their_bytes_are_reused():
    graph = bg.BreakableCUDAGraph()
    x = torch.randn(1 << 20, device=DEV)  # 4 MiB per activation
    layers = 32
    with bg.BreakableCUDAGraphCapture(graph):
        h = x
        first = scale_eager(h, factor=1.0)
        ref = weakref.ref(first)
        h = first + 1
        del first
        for _ in range(layers - 1):
            h = scale_eager(h, factor=1.0) + 1
        out = h
    gc.collect()
    assert ref() is None, "the break's result was kept alive by the graph"
    held = bg.pool_bytes(graph.pool)
    assert held < 8 * x.nbytes, f"pool holds {held} bytes: break results were pinned"
    for _ in range(2):
        fresh = torch.randn_like(x)
        x.copy_(fresh)
        poison_(out)
        graph.replay()
        assert_close(out, fresh + layers)


def test_concurrent_captures_in_two_threads():
    results, errors = {}, []
    barrier = threading.Barrier(2)

    def work(tag, factor):
        try:
            stream = torch.cuda.Stream()
            graph = bg.BreakableCUDAGraph()
            x = inputs[tag].clone()  # not drawn here: the other thread's capture may hold the generator
            with torch.cuda.stream(stream):
                x = x + 0
                x @ x  # cuBLAS handles are per thread: create this thread's outside the capture
            stream.synchronize()
            barrier.wait()
            with bg.BreakableCUDAGraphCapture(graph, stream=stream, capture_error_mode="thread_local"):
                barrier.wait()  # both threads are capturing now
                y = softmax_eager(x * factor)
                out = scale_eager(y @ y, factor)
                barrier.wait()
            assert graph.num_eager_breaks == 2
            checks = []
            for fresh in refills[tag]:
                x.copy_(fresh)
                poison_(out)
                with torch.cuda.stream(stream):
                    graph.replay()
                stream.synchronize()
                y = torch.softmax(fresh * factor, -1)
                checks.append(torch.allclose(out, (y @ y) * factor, atol=1e-4, rtol=1e-4))
            results[tag] = checks
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)
            barrier.abort()

    inputs = [torch.randn(128, 128, device=DEV) for _ in range(2)]
    refills = [[torch.randn(128, 128, device=DEV) for _ in range(2)] for _ in range(2)]
    threads = [threading.Thread(target=work, args=(i, 1.5 + i)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results == {0: [True, True], 1: [True, True]}


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
