"""Cross-size pool churn: graphs of several sizes share one pool; captures, resets, drops and
recaptures in any order, and every remaining graph still replays equal to eager."""

import os

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import breakgraph as bg
from tests.helpers import assert_close, poison_

DEV = "cuda"
SIZES = (16, 8, 4, 2, 1)
EXAMPLES = int(os.environ.get("BREAKGRAPH_CHURN_EXAMPLES", "40"))


@bg.eager_on_graph
def fresh_softmax(h):
    return torch.softmax(h, -1)  # a fresh tensor at every replay, written back into the captured one


@bg.eager_on_graph
def mix(h, x):
    return h * x.mean(-1, keepdim=True)  # reads an intermediate and a static view, both non-owning


class Model:
    def __init__(self):
        gen = torch.Generator(device=DEV).manual_seed(0)
        self.w = torch.randn(32, 64, device=DEV, generator=gen) / 8
        self.w2 = torch.randn(64, 32, device=DEV, generator=gen) / 8

    def __call__(self, x):
        h = fresh_softmax(torch.relu(x @ self.w))
        h = mix(h @ self.w2 + 1, x)
        return h.sum(-1)


operations = st.lists(st.tuples(st.sampled_from(["replay", "reset", "drop", "capture"]), st.sampled_from(SIZES)), max_size=24)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations)
def test_graphs_sharing_a_pool_survive_any_sequence_of_captures_resets_and_drops(operations):
    model = Model()
    static = torch.randn(max(SIZES), 32, device=DEV)
    model(static)  # warm up
    pool = torch.cuda.MemPool()
    graphs = {}

    def capture(size):
        graph = bg.BreakableCUDAGraph(pool=pool)
        with bg.BreakableCUDAGraphCapture(graph):
            out = model(static[:size])
        graphs[size] = (graph, out)

    def check(size):
        graph, out = graphs[size]
        fresh = torch.randn(size, 32, device=DEV)
        static[:size].copy_(fresh)
        poison_(out)
        graph.replay()
        assert_close(out, model(fresh), 1e-4, 1e-4)

    for size in SIZES:  # largest first, as the runner captures
        capture(size)
    for operation, size in operations:
        if operation == "replay" and size in graphs:
            check(size)
        elif operation == "reset" and size in graphs:
            graphs.pop(size)[0].reset()
        elif operation == "drop" and size in graphs:
            del graphs[size]  # dropped without reset
        elif operation == "capture" and size not in graphs:
            capture(size)
    for size in sorted(graphs, reverse=True):
        check(size)
