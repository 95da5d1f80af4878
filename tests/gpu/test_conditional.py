"""cond and while_loop as CUDA conditional nodes: replay against eager on fresh inputs with
poisoned outputs, nesting, the callable forms, and the refusals and failures that leave
nothing behind."""

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import breakgraph as bg
import breakgraph_bindings as bindings
from tests.helpers import assert_close, check_against_eager, poison_, softmax_eager

DEV = "cuda"
EXAMPLES = int(os.environ.get("BREAKGRAPH_PROGRAM_EXAMPLES", "30"))


def _replays_match(fn, inputs, fresh, trials=6, **capture):
    """Capture ``fn(*inputs)``; then, ``trials`` times, refill the inputs with ``fresh(i)``,
    poison the outputs, replay, and compare with eager."""
    graph = bg.BreakableCUDAGraph()
    with torch.no_grad():
        fn(*inputs)
        with bg.BreakableCUDAGraphCapture(graph, **capture):
            out = fn(*inputs)
        for trial in range(trials):
            for static, new in zip(inputs, fresh(trial)):
                static.copy_(new)
            poison_(out)
            graph.replay()
            torch.cuda.synchronize()
            assert_close(out, fn(*inputs), atol=1e-4, rtol=1e-4)
    return graph, out


def _signed(shape, trial):
    """Fresh values whose sum is positive on even trials and negative on odd ones."""
    x = torch.randn(shape, device=DEV).abs() + 0.1
    return x if trial % 2 == 0 else -x


# -- cond -------------------------------------------------------------------------------------


def _branchy(x, w):
    h = torch.relu(x @ w)
    out = bg.cond(x.sum() > 0, lambda a, b: {"y": a @ b, "n": a.norm()}, lambda a, b: {"y": a * 3 - b.sum(), "n": a.sum()}, h, w)
    return out["y"] + 1, out["n"]


def test_cond_runs_the_branch_the_device_picks_in_one_segment():
    x, w = torch.randn(8, 8, device=DEV), torch.randn(8, 8, device=DEV)
    picks = []

    def fresh(trial):
        new = (_signed((8, 8), trial), torch.randn(8, 8, device=DEV))
        picks.append(bool(new[0].sum() > 0))
        return new

    graph, _ = _replays_match(_branchy, [x, w], fresh, trials=12)
    assert graph.num_graphs == 1 and graph.num_eager_breaks == 0
    assert len(set(picks)) == 2, "both branches should have been taken"


def test_cond_output_never_aliases_an_operand_or_a_weight():
    weight = torch.randn(16, device=DEV)
    x = torch.randn(16, device=DEV)
    graph, out = _replays_match(
        lambda x: bg.cond(x.sum() > 0, lambda a: (a, weight), lambda a: (a * 2, a + 1), x),
        [x],
        lambda trial: [_signed(16, trial)],
    )
    saved = weight.clone()
    x.copy_(-x.abs())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(weight, saved) and out[0].data_ptr() != x.data_ptr()


def test_cond_between_breaks_and_after_a_random_op():
    def fn(x):
        noise = torch.rand_like(x)  # the segment goes on in a capture torch records
        y = bg.cond(x.sum() > 0, lambda a: a.exp(), lambda a: a.neg(), x)
        y = softmax_eager(y)
        y = bg.cond(y.max() > 0.5, lambda a: a * 2, lambda a: a - 1, y)
        return y, noise + torch.rand_like(x)  # after a conditional node, in the same segment

    x = torch.randn(4, 8, device=DEV)
    graph = bg.BreakableCUDAGraph()
    with bg.BreakableCUDAGraphCapture(graph):
        out, noise = fn(x)
    draws = []
    for trial in range(6):
        x.copy_(_signed((4, 8), trial))
        poison_(out)
        graph.replay()
        torch.cuda.synchronize()
        y = x.exp() if x.sum() > 0 else x.neg()
        y = torch.softmax(y, -1)
        assert_close(out, y * 2 if y.max() > 0.5 else y - 1)
        draws.append(noise.clone())
    assert not torch.equal(draws[0], draws[1]), "the random op draws afresh at each replay"


def test_cond_in_graphed_and_in_a_runner():
    x = torch.randn(8, 4, device=DEV)
    step = bg.graphed(lambda x: bg.cond(x.mean() > 0, lambda a: a.cumsum(0), lambda a: a.flip(0), x), x)
    for trial in range(4):
        x.copy_(_signed((8, 4), trial))
        assert_close(step(), x.cumsum(0) if x.mean() > 0 else x.flip(0))

    def model(x):
        return bg.cond(x[:, 0].sum() > 0, lambda a: a * 2, lambda a: a.abs(), x)

    runner = bg.GraphRunner(model, [torch.zeros(8, 4, device=DEV)], capture_sizes=[2, 8], progress=False)
    runner.capture()
    for n, trial in [(2, 0), (5, 1), (8, 2), (1, 3)]:
        batch = _signed((n, 4), trial)
        assert_close(runner(batch), model(batch))


def test_debug_mode_runs_cond_as_an_eager_break():
    x = torch.randn(6, device=DEV)
    graph = bg.BreakableCUDAGraph(debug=True)
    with bg.BreakableCUDAGraphCapture(graph):
        out = bg.cond(x.sum() > 0, lambda a: a + 1, lambda a: a - 1, x) * 2
    assert graph.num_eager_breaks == 1 and [s.name for s in graph.segments if s.kind == "eager"] == ["cond"]
    for trial in range(4):
        x.copy_(_signed(6, trial))
        poison_(out)
        graph.replay()
        assert_close(out, (x + 1 if x.sum() > 0 else x - 1) * 2)


@pytest.mark.parametrize("debug", [False, True])
def test_a_branch_that_returns_a_weight_never_has_the_other_branch_written_over_it(debug):
    weight, x = torch.randn(16, device=DEV), torch.randn(16, device=DEV).abs()
    graph = bg.BreakableCUDAGraph(debug=debug)  # debug mode: cond is an eager break, its result written back
    with torch.no_grad(), bg.BreakableCUDAGraphCapture(graph):
        out = bg.cond(x.sum() > 0, lambda: weight, lambda: weight * 5) + 0  # captured taking true_fn
    saved = weight.clone()
    for trial in range(4):
        x.copy_(_signed(16, trial))
        poison_(out)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(weight, saved)
        assert_close(out, saved if trial % 2 == 0 else saved * 5)


def test_many_conds_in_one_segment_reuse_the_memory_their_bodies_free():
    x = torch.randn(1 << 20, device=DEV)  # 4 MiB a result

    def fn(x):
        for i in range(48):
            x = bg.cond(x[i] > 0, lambda a: a * 0.5 + 1, lambda a: a.roll(1) - 0.25, x)
        return x

    graph, out = _replays_match(fn, [x], lambda trial: [torch.randn(1 << 20, device=DEV)], trials=3)
    assert graph.num_graphs == 1
    assert bg.pool_bytes(graph.pool) < 8 * x.nbytes, "each body's freed results serve the next bodies"


def test_segments_with_conditional_nodes_keep_their_own_executables():
    graphs, outs, inputs = [], [], []
    for n in (4, 8):
        x = torch.randn(n, device=DEV)
        graph = bg.BreakableCUDAGraph()
        with bg.BreakableCUDAGraphCapture(graph):
            out = bg.cond(x.sum() > 0, lambda a: a * 2, lambda a: a - 3, softmax_eager(x * 1.5))
        graphs.append(graph), outs.append(out), inputs.append(x)
    refusals = bg.share_executables(graphs)
    assert {(r.segment, r.reason) for r in refusals} == {(2, "conditional nodes")}
    assert graphs[1].segments[0].shared is not None, "the segment before the break is shared"
    for trial in range(6):
        for graph, out, x in zip(graphs, outs, inputs):
            x.copy_(torch.randn_like(x))
            poison_(out)
            graph.replay()
            s = torch.softmax(x * 1.5, -1)
            assert_close(out, s * 2 if x.sum() > 0 else s - 3)


# -- while_loop -------------------------------------------------------------------------------


def _counted(limit, x, steps):
    def body(i, acc, v):
        return i + 1, acc + v * (i + 1), v.roll(1)

    return bg.while_loop(lambda i, acc, v: i < limit, body, (steps, torch.zeros_like(x), x))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(counts=st.lists(st.integers(0, 12), min_size=3, max_size=6))
def test_while_loop_runs_as_many_times_as_the_device_says(counts):
    limit = torch.tensor(counts[0], device=DEV)
    x, steps = torch.randn(8, device=DEV), torch.zeros((), dtype=torch.long, device=DEV)
    graph, out = _replays_match(
        lambda limit, x: _counted(limit, x, steps)[1:],
        [limit, x],
        lambda trial: [torch.tensor(counts[trial % len(counts)], device=DEV), torch.randn(8, device=DEV)],
        trials=len(counts),
    )
    assert graph.num_graphs == 1 and graph.num_eager_breaks == 0
    assert int(steps) == 0, "carried is never modified"


def test_while_loop_with_swapped_carries_and_a_cond_inside():
    def fn(a, b, n):
        def body(i, a, b):
            b = bg.cond(i % 2 == 0, lambda t: t * 2, lambda t: t + 1, b)
            return i + 1, b, a  # swapped: each is the other's next value

        i = torch.zeros((), dtype=torch.long, device=DEV)
        return bg.while_loop(lambda i, a, b: i < n, body, (i, a, b))[1:]

    a, b, n = torch.randn(5, device=DEV), torch.randn(5, device=DEV), torch.tensor(3, device=DEV)
    _replays_match(fn, [a, b, n], lambda t: [torch.randn(5, device=DEV), torch.randn(5, device=DEV), torch.tensor(t + 1, device=DEV)])


def test_cond_with_a_while_loop_inside():
    def fn(x, n):
        grow = lambda a: bg.while_loop(lambda t: t.sum() < n, lambda t: (t * 1.5 + 0.1,), (a.abs(),))[0]  # noqa: E731
        return bg.cond(x[0] > 0, grow, lambda a: a - 1, x)

    x, n = torch.randn(6, device=DEV), torch.tensor(20.0, device=DEV)
    _replays_match(fn, [x, n], lambda t: [_signed(6, t), torch.tensor(5.0 + 10 * t, device=DEV)])


# -- random programs ----------------------------------------------------------------------------

_STEPS = {
    "scale": lambda x: x * 0.9 + 0.05,
    "matmul": lambda x: torch.tanh(x @ x.T)[:, : x.shape[1]] if x.shape[0] >= x.shape[1] else x.tanh(),
    "break": lambda x: softmax_eager(x) * 4 - 1,
    "cond": lambda x: bg.cond(x.mean() > 0, lambda a: a.sin(), lambda a: a.cos() - 0.5, x),
    "while": lambda x: bg.while_loop(lambda t: t.abs().max() < 8, lambda t: (t * 2 + 0.01,), (x,))[0],
    "nested": lambda x: bg.cond(
        x[0, 0] > 0, lambda a: bg.while_loop(lambda t: t.sum() < 4, lambda t: (t.abs() + 0.5,), (a,))[0], lambda a: a.flip(0), x
    ),
}


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(program=st.lists(st.sampled_from(sorted(_STEPS)), min_size=1, max_size=7))
def test_random_programs_of_ops_breaks_and_conditionals_match_eager(program):
    def fn(x):
        for step in program:
            x = _STEPS[step](x)
        return x

    x = torch.randn(6, 6, device=DEV)
    graph, _ = check_against_eager(fn, [x], trials=4, atol=1e-4, rtol=1e-4)
    assert graph.num_eager_breaks == program.count("break")


# -- refusals and failures --------------------------------------------------------------------


_SYNCHRONIZERS = (torch.cuda.synchronize, torch.cuda.Stream.synchronize, torch.cuda.Event.synchronize)


def _assert_next_capture_works():
    assert not bg.is_capturing()
    assert bindings.capture_status(torch.cuda.current_stream()) is bindings.CaptureStatus.NONE
    assert (torch.cuda.synchronize, torch.cuda.Stream.synchronize, torch.cuda.Event.synchronize) == _SYNCHRONIZERS
    x = torch.randn(6, device=DEV)
    _replays_match(lambda x: bg.cond(x.sum() > 0, lambda a: a + 1, lambda a: a * 3, x), [x], lambda t: [_signed(6, t)])


@bg.eager_on_graph
def _host_work(x):
    return x + 1


_REFUSED = {
    "break": (lambda a: _host_work(a), "is an eager break inside the body"),
    "random": (lambda a: a + torch.rand_like(a), "the random op"),
    "item": (lambda a: a * a.sum().item(), "synchronizes the GPU with the host"),
    "nonzero": (lambda a: a.nonzero().float().sum() + a, "synchronizes the GPU with the host"),
    "mask": (lambda a: a.masked_fill(a > 0, 0)[a != 0].sum() + a, "synchronizes the GPU with the host"),
    "synchronize": (lambda a: torch.cuda.synchronize() or a, "torch.cuda.synchronize()"),
    "to host": (lambda a: a.cpu().cuda(), "a copy between the host and the GPU"),
    "unique": (lambda a: a + torch.unique(a).sum(), "synchronizes the GPU with the host"),
    "cpu result": (lambda a: a.sum().cpu(), "a copy between the host and the GPU"),
    "shape": (lambda a: a[:2], "shape torch.Size([2]) from true_fn but torch.Size([6]) from false_fn"),
    "dtype": (lambda a: a.half(), "dtype torch.float16 from true_fn but torch.float32"),
    "structure": (lambda a: (a, a), "must give the same structure"),
}


@pytest.mark.parametrize("what", sorted(_REFUSED))
def test_what_a_body_cannot_hold_is_refused_and_leaves_nothing_behind(what):
    branch, message = _REFUSED[what]
    x = torch.randn(6, device=DEV)
    graph = bg.BreakableCUDAGraph()
    with pytest.raises((bg.UncapturableOpError, TypeError), match=re.escape(message)):
        with bg.BreakableCUDAGraphCapture(graph):
            bg.cond(x.sum() > 0, branch, lambda a: a * 2, x)
    assert not graph.captured
    _assert_next_capture_works()


def test_a_while_loop_body_refuses_a_break_and_a_cpu_carry_is_refused():
    x = torch.randn(6, device=DEV)
    with pytest.raises(bg.UncapturableOpError, match="is an eager break inside the body"):
        with bg.BreakableCUDAGraphCapture(bg.BreakableCUDAGraph()):
            bg.while_loop(lambda t: t.sum() < 10, lambda t: (_host_work(t),), (x,))
    _assert_next_capture_works()
    with pytest.raises(ValueError, match=re.escape("carried[1] is on cpu")):
        with bg.BreakableCUDAGraphCapture(bg.BreakableCUDAGraph()):
            bg.while_loop(lambda t, n: t.sum() < 10, lambda t, n: (t + 1, n), (x, torch.zeros(2)))
    _assert_next_capture_works()


_OUTSIDE = torch.cuda.Stream() if torch.cuda.is_available() else None


def test_a_body_waiting_on_a_stream_outside_the_capture_is_refused_and_leaves_nothing_behind():
    x = torch.randn(6, device=DEV)
    graph = bg.BreakableCUDAGraph()
    with pytest.raises(bg.StreamJoinError, match="capturing a conditional body"):
        with bg.BreakableCUDAGraphCapture(graph):
            bg.cond(x.sum() > 0, lambda a: torch.cuda.current_stream().wait_stream(_OUTSIDE) or a + 1, lambda a: a * 2, x)
    assert not graph.captured
    _assert_next_capture_works()


def test_a_body_error_caught_inside_the_capture_still_fails_the_capture():
    x = torch.randn(6, device=DEV)
    graph = bg.BreakableCUDAGraph()
    with pytest.raises(bg.UncapturableOpError, match="cond's true_fn failed .* half built"):
        with bg.BreakableCUDAGraphCapture(graph):
            try:
                bg.cond(x.sum() > 0, lambda a: a * a.sum().item(), lambda a: a, x)
            except bg.UncapturableOpError:
                pass  # the caller goes on: the node it half built must not reach a graph
    assert not graph.captured
    _assert_next_capture_works()


def test_a_predicate_on_the_wrong_device_is_refused():
    x = torch.randn(6, device=DEV)
    with pytest.raises(ValueError, match="cond's pred is on cpu"):
        with bg.BreakableCUDAGraphCapture(bg.BreakableCUDAGraph()):
            bg.cond(torch.tensor(True), lambda a: a, lambda a: a * 2, x)
    _assert_next_capture_works()


_CAPTURE_IN_A_PROCESS_OF_ITS_OWN = """
import os, torch, breakgraph as bg
x = torch.randn(6, device="cuda")
{true_fn}
synchronize = torch.cuda.Stream.synchronize
try:
    with bg.BreakableCUDAGraphCapture(bg.BreakableCUDAGraph()):
        bg.cond(x.sum() > 0, query, lambda a: a * 2, x)
except bg.UncapturableOpError as error:
    print("refused:", error)
assert not bg.is_capturing() and torch.cuda.Stream.synchronize is synchronize
print("ok", flush=True)
os._exit(0)
"""


def _capture_in_a_process_of_its_own(true_fn: str) -> str:
    """Capture a cond whose true_fn is ``query``, defined by ``true_fn``, where a crash cannot
    take pytest down; leave at once (CUDA's state may be lost). Its output, which ends in "ok"."""
    script = _CAPTURE_IN_A_PROCESS_OF_ITS_OWN.format(true_fn=textwrap.dedent(true_fn))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("ok") and "restart the process" in done.stdout, done.stdout
    return done.stdout


def test_a_body_cuda_invalidates_is_refused_and_its_capture_left_behind_says_so():
    """A call CUDA refuses in a body, which the op watch cannot see, invalidates the body's
    capture, and the driver crashes when such a capture is ended (NVBUG 6805256): the error
    says to restart (CUDA's state is lost: the next CUDA call may crash or hang), and the
    capture's hooks are gone."""
    out = _capture_in_a_process_of_its_own(
        """
        def query(a):
            torch.cuda.current_stream().query()  # no op of torch's: CUDA refuses it mid-capture
            return a
        """
    )
    assert "(<string>:6) made CUDA refuse the capture of cond's true_fn" in out


def test_a_body_that_catches_cudas_refusal_is_refused_when_it_returns_and_its_capture_left_behind():
    """A body that catches CUDA's refusal and goes on returns with its capture invalidated,
    which the driver crashes on ending (NVBUG 6805256): the capture is left open, the error
    says so, and the capture around it fails cleanly."""
    out = _capture_in_a_process_of_its_own(
        """
        def query(a):
            done = a + 1  # the body's work, before the call CUDA refuses
            try:
                torch.cuda.current_stream().query()  # CUDA refuses it mid-capture
            except RuntimeError:
                pass
            return done
        """
    )
    assert "the capture of cond's true_fn was invalidated by the time it returned" in out
