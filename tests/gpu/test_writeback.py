"""Breaks returning structures feed later segments; replay writes fresh results into captured buffers."""

import dataclasses
import gc

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


def test_a_break_that_returned_its_argument_at_capture_and_a_new_tensor_at_replay_is_refused():
    @bg.eager_on_graph
    def clip(x):
        return x if x.abs().max() < 10 else x.clamp(-10, 10)

    x = torch.full((4,), 1.0, device=DEV)
    graph = bg.BreakableCUDAGraph()
    with bg.BreakableCUDAGraphCapture(graph):
        h = x * 1
        out = h + clip(h)  # clip returned h itself: the last segment reads its result where h lives
    fresh = torch.randn(4, device=DEV)
    x.copy_(fresh)
    poison_(out)
    graph.replay()  # small values: clip returns h again
    assert_close(out, fresh * 2)
    x.fill_(100.0)
    with pytest.raises(bg.WritebackError, match=r"clip\(\) -> out: an argument's memory at capture"):
        graph.replay()  # large values: a new tensor, which copied into h would give clamp + clamp, not h + clamp
    torch.cuda.synchronize()
    assert torch.equal(h, torch.full((4,), 100.0, device=DEV))  # nothing written over it


def test_a_host_tensor_the_body_made_for_a_break_is_kept_alive_for_its_replays():
    @bg.eager_on_graph
    def scale_by(x, host_lengths):
        return x * host_lengths.sum().item()

    x = torch.randn(4, device=DEV)
    graph = bg.BreakableCUDAGraph()
    with bg.BreakableCUDAGraphCapture(graph):
        out = scale_by(x * 1, torch.tensor([2.0, 3.0])) + 1  # a host temporary, dropped as the body goes on
    gc.collect()
    churn = [torch.full((2,), -7.0) for _ in range(1000)]  # host memory reused, were it freed
    for _ in range(3):
        fresh = torch.randn(4, device=DEV)
        x.copy_(fresh)
        poison_(out)
        graph.replay()
        assert_close(out, fresh * 5 + 1)
    del churn
