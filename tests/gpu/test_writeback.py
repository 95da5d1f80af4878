"""Breaks returning structures feed later segments; replay writes fresh results into captured buffers."""

import dataclasses

import pytest
import torch

import breakgraph as bg
from tests.helpers import assert_close, poison_

DEV = "cuda"


@dataclasses.dataclass
class AttnOut:
    out: torch.Tensor
    lse: torch.Tensor
    num_tokens: int


class Meta:
    def __init__(self, scale, extra):
        self.scale = scale
        self.extra = extra


@bg.eager_on_graph
def as_tuple(x):
    return x.exp(), (x * 2, x.sum(0))


@bg.eager_on_graph
def as_dict(x):
    return {"k": [x + 1, x.t().contiguous()], "v": x.abs()}


@bg.eager_on_graph
def as_dataclass(x):
    return AttnOut(torch.softmax(x, -1), torch.logsumexp(x, -1), x.shape[0])


@bg.eager_on_graph
def as_object(x):
    return Meta(x.mean(0), {"m": [x.max(0).values]})


def model(x):
    a, (b, c) = as_tuple(x * 0.1)
    d = as_dict(a + b)
    e = as_dataclass(d["k"][0] - d["k"][1].t() + c)
    f = as_object(e.out * e.lse[:, None] + d["v"])
    return f.scale * 3 + f.extra["m"][0]


def test_every_structure_feeds_later_segments():
    x = torch.randn(16, 16, device=DEV)
    graph = bg.BreakableCUDAGraph()
    with bg.BreakableCUDAGraphCapture(graph):
        out = model(x)
    assert graph.num_eager_breaks == 4
    for _ in range(4):
        fresh = torch.randn_like(x)
        x.copy_(fresh)
        poison_(out)
        graph.replay()
        assert_close(out, model(fresh), 1e-4, 1e-4)
        assert graph.bytes_written_per_replay > 0


def test_view_of_out_argument_is_not_copied():
    @bg.eager_on_graph
    def fill_into(x, out):
        torch.mul(x, 2, out=out)
        return out[:, :4]

    x, out = torch.randn(8, 8, device=DEV), torch.empty(8, 8, device=DEV)
    graph = bg.BreakableCUDAGraph()
    with bg.BreakableCUDAGraphCapture(graph):
        y = fill_into(x + 1, out) + 5
    for _ in range(2):
        fresh = torch.randn_like(x)
        x.copy_(fresh)
        poison_(y)
        graph.replay()
        assert_close(y, (fresh + 1)[:, :4] * 2 + 5)
    assert graph.segments[1].bytes_written == 0


def test_shape_change_at_replay_names_the_path_and_graph_stays_replayable():
    state = {"rows": 4}

    @bg.eager_on_graph
    def attention(x):
        return {"k": [x[: state["rows"]] * 2]}

    x = torch.randn(8, 8, device=DEV)
    graph = bg.BreakableCUDAGraph()
    with bg.BreakableCUDAGraphCapture(graph):
        out = attention(x)["k"][0] + 1
    state["rows"] = 5
    with pytest.raises(bg.WritebackError) as info:
        graph.replay()
    assert "attention() -> out['k'][0]: shape (4, 8) at capture, (5, 8) at replay" in str(info.value)
    state["rows"] = 4
    fresh = torch.randn_like(x)
    x.copy_(fresh)
    poison_(out)
    graph.replay()
    assert_close(out, fresh[:4] * 2 + 1)
