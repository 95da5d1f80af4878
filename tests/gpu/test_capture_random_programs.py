"""Random programs of ops, random ops, breaks, side-stream work (forked across a break, too) and
events a break records for a later segment, captured and compared with eager: on one thread or
two capturing at once, in normal and in debug mode."""

import os

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import breakgraph as bg
from tests.gpu.threads import generator_lock, run_together
from tests.helpers import assert_close, poison_

DEV = "cuda"
EXAMPLES = int(os.environ.get("BREAKGRAPH_PROGRAM_EXAMPLES", "30"))


@bg.eager_on_graph
def eager_softmax(x):
    return torch.softmax(x, -1)


@bg.eager_on_graph
def eager_tuple(x):
    return {"a": x.cumsum(-1) / x.shape[-1], "b": (x.tanh(),)}


@bg.eager_on_graph
def eager_inplace(x, out):
    out.copy_(x.flip(-1))
    return out


@bg.eager_on_graph
def eager_half_on_side(x, out, side, done):
    """A break that works on a side stream and records an event there, for a later segment to wait on."""
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.mul(x, 0.5, out=out)
    done.record(side)


def _event_from_break(x, buf, side):
    done = torch.cuda.Event()  # made anew at every call, as a model may
    eager_half_on_side(x, buf, side, done)
    torch.cuda.current_stream().wait_event(done)
    return buf + 1


def _side_across_break(x, w, side):
    """Side-stream work still forked while a break runs, joined after it."""
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = torch.relu(x @ w)
    soft = eager_softmax(x)
    torch.cuda.current_stream().wait_stream(side)
    return y / 4 + soft


def _side(x, w, side):
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = torch.relu(x @ w)
    torch.cuda.current_stream().wait_stream(side)
    return y


OPS = {
    "relu_matmul": lambda x, w, buf, side: torch.relu(x @ w) / 4,
    "add": lambda x, w, buf, side: x + 1.5,
    "mul": lambda x, w, buf, side: x * 0.7,
    "norm": lambda x, w, buf, side: x / (x.norm(dim=-1, keepdim=True) + 1),
    "reduce": lambda x, w, buf, side: x - x.mean(dim=0, keepdim=True),
    "softmax_break": lambda x, w, buf, side: eager_softmax(x),
    "tuple_break": lambda x, w, buf, side: (lambda r: r["a"] + r["b"][0])(eager_tuple(x)),
    "inplace_break": lambda x, w, buf, side: eager_inplace(x, buf) * 2,
    "split": lambda x, w, buf, side: (bg.break_graph(), x)[1],
    "side_stream": lambda x, w, buf, side: _side(x, w, side),
    "side_across_break": lambda x, w, buf, side: _side_across_break(x, w, side),
    "event_from_break": lambda x, w, buf, side: _event_from_break(x, buf, side),
    "dropout": lambda x, w, buf, side: torch.nn.functional.dropout(x, 0.3, training=True),
    "noise": lambda x, w, buf, side: x + torch.randn_like(x) * 0.1,
}
programs = st.lists(st.sampled_from(sorted(OPS)), min_size=1, max_size=12)


class Program:
    """One program's weights, buffers and streams, captured on ``stream``."""

    def __init__(self, ops):
        self.ops = ops
        self.stream, self.side = torch.cuda.Stream(), torch.cuda.Stream()
        self.w = torch.randn(16, 16, device=DEV) / 4
        self.x = torch.randn(8, 16, device=DEV)
        self.buf = torch.empty(8, 16, device=DEV)
        self.inputs = torch.Generator(device=DEV).manual_seed(len(ops))  # fresh inputs, apart from the default generator

    def warm_up(self) -> None:
        """On the capturing thread: cuBLAS makes a handle per thread, and a workspace per
        stream, which must not happen inside the capture."""
        for stream in (self.stream, self.side):
            with torch.cuda.stream(stream):
                self.x @ self.w
            stream.synchronize()

    def run(self, inp):
        for name in self.ops:
            inp = OPS[name](inp, self.w, self.buf, self.side)
        return inp + 0  # a fresh output even when every op passed its input through

    def capture(self, debug: bool, mode: str = "global"):
        graph = bg.BreakableCUDAGraph(debug=debug)
        with bg.BreakableCUDAGraphCapture(graph, stream=self.stream, capture_error_mode=mode):
            out = self.run(self.x)
        expected_breaks = sum(name.endswith("break") or name == "split" for name in self.ops)
        assert graph.num_eager_breaks == expected_breaks
        assert graph.draws_random_numbers == any(name in ("dropout", "noise") for name in self.ops)
        return graph, out

    def check(self, graph, out) -> None:
        """Two replays on fresh inputs, poisoned outputs, eager on the same generator offsets."""
        for _ in range(2):
            with generator_lock, torch.cuda.stream(self.stream):
                fresh = torch.randn(self.x.shape, device=DEV, generator=self.inputs)
                self.x.copy_(fresh)
                poison_(out)
                rng_state = torch.cuda.get_rng_state()
                graph.replay()
                torch.cuda.set_rng_state(rng_state)  # eager draws what the replay drew: the same offsets
                expected = self.run(fresh)
                self.stream.synchronize()
            assert_close(out, expected, 1e-4, 1e-4)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs, st.booleans())
def test_random_program_matches_eager(ops, debug):
    program = Program(ops)
    program.warm_up()
    program.check(*program.capture(debug))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs, programs, st.booleans())
def test_two_random_programs_captured_at_once_in_two_threads_match_eager(first, second, debug):
    def task(program):
        def work(barrier):
            program.warm_up()
            barrier.wait()
            graph, out = program.capture(debug, mode="thread_local")
            barrier.wait()  # both captures have ended before either checks
            program.check(graph, out)

        return work

    run_together([task(Program(first)), task(Program(second))])
