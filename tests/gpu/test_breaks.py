"""What breaks may do with tensors: autograd history (inference is fine, backward is refused),
and debug mode's report of tensors a break keeps outside its result."""

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import breakgraph as bg
from breakgraph.recording.breaks import record_break
from tests.helpers import assert_close, poison_
from tests.test_breaks import argument_strategies, check_replay_arguments

DEV = "cuda"
_leaves, _values = argument_strategies("cuda", "cpu")


@bg.eager_on_graph
def normalize(h):
    return h / h.norm(dim=-1, keepdim=True)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)).to(DEV)  # parameters require grad


@pytest.mark.parametrize("context", ["grad enabled", "no_grad", "inference_mode"])
@pytest.mark.parametrize("debug", [False, True])
def test_inference_with_grad_requiring_parameters_captures_and_replays(context, debug):
    model = _model()

    def fn(x):
        return model[2](normalize(model[1](model[0](x))))

    guard = {"grad enabled": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[context]
    with guard():
        x = torch.randn(8, 16, device=DEV)
        step = bg.graphed(fn, x, debug=debug)
        assert step.graph.num_eager_breaks == 1  # normalize, or in debug mode the whole function
        for _ in range(3):
            fresh = torch.randn_like(x)
            x.copy_(fresh)
            poison_(step.output)
            out = step.replay()
            with torch.no_grad():
                assert_close(out, fn(fresh), 1e-4, 1e-4)


@pytest.mark.parametrize("grad_enabled", [True, False])
def test_breaks_and_hooks_replay_with_autograd_off_and_the_callers_mode_comes_back(grad_enabled):
    seen, fail = [], [False]

    @bg.eager_on_graph
    def scaled(h):
        seen.append(("break", torch.is_grad_enabled()))
        if fail[0]:
            raise ValueError("the break failed")
        return h * 3

    x = torch.randn(8, device=DEV)
    graph = bg.BreakableCUDAGraph()
    with bg.BreakableCUDAGraphCapture(graph):
        y = scaled(x + 1) - 2
    graph.set_replay_hooks(
        before=lambda: seen.append(("before", torch.is_grad_enabled())), after=lambda: seen.append(("after", torch.is_grad_enabled()))
    )
    with torch.set_grad_enabled(grad_enabled):
        for _ in range(2):
            seen.clear()
            fresh = torch.randn_like(x)
            x.copy_(fresh)
            poison_(y)
            graph.replay()
            assert torch.is_grad_enabled() is grad_enabled
            assert seen == [("before", False), ("break", False), ("after", False)]
            assert_close(y, (fresh + 1) * 3 - 2, 1e-6, 1e-6)
        fail[0] = True
        with pytest.raises(ValueError, match="the break failed"):
            graph.replay()
        assert torch.is_grad_enabled() is grad_enabled  # set back after a failed replay too
    torch.cuda.synchronize()


def test_a_backward_that_reaches_a_break_is_refused_there_with_the_fix():
    @bg.eager_on_graph
    def differentiable(x):
        return x.exp() * 2

    w = torch.randn(4, device=DEV, requires_grad=True)
    graph = bg.BreakableCUDAGraph()
    with bg.BreakableCUDAGraphCapture(graph):
        loss = differentiable(w * 2).sum()  # inference-style use: fine
    graph.replay()
    with pytest.raises(RuntimeError, match=r"backward reached \S*differentiable\(\) -> out.*autograd.Function"):
        loss.backward()
    # Inside a training capture the same backward fails the capture, which leaves nothing behind.
    with pytest.raises(RuntimeError, match="autograd.Function"):
        with bg.BreakableCUDAGraphCapture(bg.BreakableCUDAGraph()):
            differentiable(w * 2).sum().backward()
    assert not bg.is_capturing()


def test_debug_mode_reports_a_tensor_a_break_keeps_outside_its_result():
    kept = {}

    @bg.eager_on_graph
    def remembers(x):
        kept["scaled"] = x * 3  # allocated during capture, kept in a global
        return x + 1

    x = torch.randn(256, device=DEV)
    with pytest.warns(bg.LifetimeWarning, match=r"remembers\(\) kept 1 tensor"):
        with bg.BreakableCUDAGraphCapture(bg.BreakableCUDAGraph(debug=True)):
            remembers(x * 2) + 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", bg.LifetimeWarning)  # a break that returns what it makes: no report
        with bg.BreakableCUDAGraphCapture(bg.BreakableCUDAGraph(debug=True)):
            normalize(x * 2) + 1


@settings(max_examples=80, deadline=None)
@given(st.lists(_values, max_size=4), st.dictionaries(st.sampled_from(["x", "y", "meta"]), _values, max_size=2))
def test_replay_arguments_alias_every_plain_cuda_tensor_and_keep_everything_else(args, kwargs):
    segment = record_break(0, "attention", lambda *a, **k: None, tuple(args), kwargs, None, None)
    check_replay_arguments(tuple(args), kwargs, segment)
