"""Training steps, autograd breaks, AMP and random ops under breakable capture."""

import copy

import pytest
import torch
from torch import nn

import breakgraph as bg
from tests.helpers import assert_close, check_against_eager, poison_

DEV = "cuda"


def _net(dropout: float) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(dropout), nn.Linear(64, 8)).to(DEV)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_whole_training_step_matches_eager_sgd(dropout):
    model, reference = _net(dropout), _net(dropout)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    loss_fn = nn.MSELoss()
    x, y = torch.randn(16, 32, device=DEV), torch.randn(16, 8, device=DEV)

    # Warm up on a side stream, as with torch.cuda.graph (lazy init, grad buffers).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for net, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad(set_to_none=True)
            loss_fn(net(x), y).backward()
            o.step()
    torch.cuda.current_stream().wait_stream(side)

    graph = bg.BreakableCUDAGraph()
    opt.zero_grad(set_to_none=True)
    with bg.BreakableCUDAGraphCapture(graph):
        loss = loss_fn(model(x), y)
        bg.break_graph()  # between forward and backward
        loss.backward()
        opt.step()
    # Capture only records the graph parts, so parameters start equal for both.
    reference.load_state_dict(model.state_dict())

    for _ in range(3):
        fresh_x, fresh_y = torch.randn_like(x), torch.randn_like(y)
        x.copy_(fresh_x), y.copy_(fresh_y)
        state = torch.cuda.get_rng_state()
        graph.replay()
        torch.cuda.set_rng_state(state)  # the reference draws the same dropout masks
        ref_opt.zero_grad(set_to_none=True)
        ref_loss = loss_fn(reference(fresh_x), fresh_y)
        ref_loss.backward()
        ref_opt.step()
        torch.cuda.synchronize()
        assert_close(loss, ref_loss, 1e-5, 1e-5)
        for p, q in zip(model.parameters(), reference.parameters()):
            assert_close(p, q, 1e-5, 1e-5)
    # Dropout is captured inside the segments: the only break is the explicit one.
    assert graph.num_eager_breaks == 1 and graph.draws_random_numbers == bool(dropout)


class BreakFunction(torch.autograd.Function):
    """Forward and backward each run an eager break."""

    @staticmethod
    def forward(ctx, x, w):
        y = _forward_break(x, w)
        ctx.save_for_backward(x, w, y)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, w, y = ctx.saved_tensors
        return _backward_break(grad, x, w, y)


@bg.eager_on_graph
def _forward_break(x, w):
    return torch.tanh(x @ w)


@bg.eager_on_graph
def _backward_break(grad, x, w, y):
    g = grad * (1 - y * y)
    return g @ w.t(), x.t() @ g


def test_custom_autograd_function_with_breaks_in_forward_and_backward():
    torch.manual_seed(1)
    w = torch.randn(16, 16, device=DEV, requires_grad=True)
    lin = nn.Linear(16, 16, device=DEV)
    x = torch.randn(8, 16, device=DEV)

    def step(inp):
        out = lin(BreakFunction.apply(lin(inp), w)).sum()
        out.backward()
        return out

    step(x)  # warm up
    w.grad = None
    lin.zero_grad(set_to_none=True)
    graph = bg.BreakableCUDAGraph()
    with bg.BreakableCUDAGraphCapture(graph):
        loss = step(x)
    names = [s.name for s in graph.segments if s.kind == "eager"]
    assert any("_forward_break" in n for n in names) and any("_backward_break" in n for n in names)
    grads = (w.grad, lin.weight.grad)
    for _ in range(2):
        fresh = torch.randn_like(x)
        x.copy_(fresh)
        poison_(grads), poison_(loss)
        graph.replay()
        w_ref, lin_ref = w.detach().clone().requires_grad_(), copy.deepcopy(lin)
        lin_ref.zero_grad(set_to_none=True)
        ref = lin_ref(torch.tanh(lin_ref(fresh) @ w_ref)).sum()
        ref.backward()
        assert_close(loss, ref, 1e-4, 1e-4)
        assert_close(w.grad, w_ref.grad, 1e-4, 1e-4)
        assert_close(lin.weight.grad, lin_ref.weight.grad, 1e-4, 1e-4)


def test_amp_autocast_inside_capture():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)).to(DEV)

    @bg.eager_on_graph
    def norm(h):
        return h / h.float().norm(dim=-1, keepdim=True).to(h.dtype)

    def fn(x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = model[0](x)
            h = norm(model[1](h))
            return model[2](h)

    x = torch.randn(8, 64, device=DEV)
    with torch.no_grad():
        fn(x)
        graph = bg.BreakableCUDAGraph()
        with bg.BreakableCUDAGraphCapture(graph):
            out = fn(x)
        assert out.dtype == torch.bfloat16
        for _ in range(2):
            fresh = torch.randn_like(x)
            x.copy_(fresh)
            poison_(out)
            graph.replay()
            assert_close(out, fn(fresh), 1e-2, 1e-2)


def test_a_break_captured_without_autocast_replays_without_it_under_the_callers_autocast():
    @bg.eager_on_graph
    def project(h, weight):
        return h @ weight  # float32 at capture; under the caller's autocast it would be bfloat16

    x, weight = torch.randn(8, 64, device=DEV), torch.randn(64, 64, device=DEV)
    graph = bg.BreakableCUDAGraph()
    with torch.no_grad(), bg.BreakableCUDAGraphCapture(graph):
        out = project(x + 1, weight) * 2
    assert out.dtype == torch.float32
    for _ in range(2):
        fresh = torch.randn_like(x)
        x.copy_(fresh)
        poison_(out)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            graph.replay()
            assert torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16
        assert_close(out, ((fresh + 1) @ weight) * 2, 1e-4, 1e-4)


def test_random_ops_error_mode_refuses_random_ops_clearly_and_leaves_nothing_behind():
    caller = torch.cuda.current_stream()
    graph = bg.BreakableCUDAGraph()
    x = torch.ones(1000, device=DEV)
    with pytest.raises(bg.UncapturableOpError) as info:
        with bg.BreakableCUDAGraphCapture(graph, random_ops="error"):
            y = x * 2
            torch.nn.functional.dropout(y, p=0.5, training=True)
    message = str(info.value)
    assert "random_ops='graph'" in message and "@breakgraph.eager_on_graph" in message
    assert "dropout" in message  # the user's line
    assert not graph.captured and not bg.is_capturing()
    assert torch.cuda.current_stream() == caller
    # The next capture works, and by default it captures the random op inside the graph.
    with bg.BreakableCUDAGraphCapture(graph):
        dropped = torch.nn.functional.dropout(x, p=0.5, training=True)
    graph.replay()
    assert graph.num_eager_breaks == 0 and 0.4 < (dropped == 0).float().mean().item() < 0.6


def test_random_ops_error_mode_captures_a_model_without_random_ops():
    model = _net(0.0)
    x = torch.randn(16, 32, device=DEV)

    @bg.eager_on_graph
    def host_side_scale(h):
        return h * float(h.abs().max().item() > -1)  # a host sync: only possible in a break

    def fn(x):
        return model(host_side_scale(torch.relu(x)))

    graph, _out = check_against_eager(fn, [x], random_ops="error")
    assert graph.num_eager_breaks == 1
