"""Random programs of ops, random ops, breaks and side-stream work, captured and compared with eager."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import breakgraph as bg
from tests.helpers import assert_close, poison_

pytestmark = pytest.mark.gpu
DEV = "cuda"


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


def _side(x, w):
    side = _SIDE[0]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = torch.relu(x @ w)
    torch.cuda.current_stream().wait_stream(side)
    return y


_SIDE = []
OPS = {
    "relu_matmul": lambda x, w, buf: torch.relu(x @ w) / 4,
    "add": lambda x, w, buf: x + 1.5,
    "mul": lambda x, w, buf: x * 0.7,
    "norm": lambda x, w, buf: x / (x.norm(dim=-1, keepdim=True) + 1),
    "reduce": lambda x, w, buf: x - x.mean(dim=0, keepdim=True),
    "softmax_break": lambda x, w, buf: eager_softmax(x),
    "tuple_break": lambda x, w, buf: (lambda r: r["a"] + r["b"][0])(eager_tuple(x)),
    "inplace_break": lambda x, w, buf: eager_inplace(x, buf) * 2,
    "split": lambda x, w, buf: (bg.break_graph(), x)[1],
    "side_stream": lambda x, w, buf: _side(x, w),
    "dropout": lambda x, w, buf: torch.nn.functional.dropout(x, 0.3, training=True),
    "noise": lambda x, w, buf: x + torch.randn_like(x) * 0.1,
}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(sorted(OPS)), min_size=1, max_size=12))
def test_random_program_matches_eager(program):
    if not _SIDE:
        _SIDE.append(torch.cuda.Stream())
    w = torch.randn(16, 16, device=DEV) / 4
    x = torch.randn(8, 16, device=DEV)
    buf = torch.empty(8, 16, device=DEV)

    def run(inp):
        for name in program:
            inp = OPS[name](inp, w, buf)
        return inp + 0  # a fresh output even when every op passed its input through

    graph = bg.BreakableCUDAGraph()
    with bg.BreakableCUDAGraphCapture(graph):
        out = run(x)
    expected_breaks = sum(name.endswith("break") or name == "split" for name in program)
    assert graph.num_eager_breaks == expected_breaks
    for _ in range(2):
        fresh = torch.randn_like(x)
        x.copy_(fresh)
        poison_(out)
        rng_state = torch.cuda.get_rng_state()
        graph.replay()
        torch.cuda.set_rng_state(rng_state)  # eager draws what the replay drew: the same offsets
        torch.cuda.synchronize()
        assert_close(out, run(fresh), 1e-4, 1e-4)
    assert graph.draws_random_numbers == any(name in ("dropout", "noise") for name in program)
