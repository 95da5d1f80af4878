"""The callable form without a GPU (or under BREAKGRAPH_DISABLE=1): eager on every replay, one warning."""

import dataclasses
import warnings
from unittest import mock

import pytest
import torch

import breakgraph as bg
from breakgraph.base.runtime import cuda_available
from breakgraph.graphs.graphed import _device_of, _tensors_to_refill

no_gpu = pytest.mark.skipif(cuda_available(), reason="checks the no-GPU fallback")


@no_gpu
def test_graphed_runs_eagerly_with_one_warning():
    calls = []

    @bg.eager_on_graph
    def attention(q):
        return torch.softmax(q, -1)

    def fn(x):
        calls.append(1)
        return attention(x) * 2

    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g = bg.graphed(fn, x)
        output = g.output
        assert output is not None and len(calls) == 1  # run once, as a capture would
        for _ in range(3):
            fresh = torch.randn_like(x)
            x.copy_(fresh)
            out = g.replay()
            assert out is output  # the same object every time, refreshed in place, as on a GPU
            torch.testing.assert_close(out, torch.softmax(fresh, -1) * 2)
    assert g.eager and len(calls) == 4
    assert len([w for w in caught if "breakgraph" in str(w.message)]) == 1


@no_gpu
def test_eager_fallback_refreshes_structured_outputs_in_place():
    def fn(x):
        return {"double": x * 2, "parts": [x + 1, x.sum()]}

    x = torch.randn(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = bg.graphed(fn, x)
    held = g.output["parts"][0]
    x.copy_(torch.ones(3))
    out = g.replay()
    assert out is g.output and out["parts"][0] is held
    torch.testing.assert_close(held, torch.full((3,), 2.0))


def test_arguments_are_checked_the_same_way_with_or_without_a_gpu():
    with pytest.raises(TypeError, match="callable"):
        bg.graphed(42, torch.ones(2))
    with pytest.raises(ValueError, match="random_ops"):
        bg.graphed(lambda x: x, torch.ones(2), random_ops="bogus")
    with pytest.raises(ValueError, match="warmup"):
        bg.graphed(lambda x: x, torch.ones(2), warmup=-1)
    with pytest.raises(TypeError, match="callable"):
        bg.GraphRunner(42, torch.ones(4, 2))
    with pytest.raises(TypeError, match="eager_on_graph"):
        bg.eager_on_graph(42)


def test_disable_env_forces_eager(monkeypatch):
    monkeypatch.setenv("BREAKGRAPH_DISABLE", "1")
    with pytest.warns(UserWarning, match="BREAKGRAPH_DISABLE=1"):
        g = bg.graphed(lambda x: x + 1, torch.ones(2))
    assert g.eager and torch.equal(g.replay(), torch.full((2,), 2.0)) and g.replay() is g.output


def test_calling_a_graphed_callable_with_new_inputs_says_to_refill_them_in_place():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = bg.graphed(lambda x: x * 2, torch.ones(3), warmup=0)
    with pytest.raises(TypeError, match=r"takes no arguments.*x\.copy_\(new\).*bg\.GraphRunner"):
        step(torch.randn(3))
    with pytest.raises(TypeError, match="takes no arguments"):
        step(x=torch.randn(3))
    assert step() is step.output  # called bare, it replays


@pytest.mark.parametrize("debug", ["yes", 1, "0"])
def test_debug_must_be_a_bool_or_none_everywhere(debug):
    with pytest.raises(TypeError, match="debug must be True, False or None"):
        bg.BreakableCUDAGraph(debug=debug)
    with pytest.raises(TypeError, match="debug must be True, False or None"):
        bg.graphed(lambda x: x, torch.ones(2), debug=debug)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(TypeError, match="debug must be True, False or None"):
            bg.GraphRunner(lambda x: x, torch.ones(4, 2), debug=debug)


def test_torchs_bare_pool_id_is_refused_saying_how_to_share_a_pool_with_torch():
    handle = (0, 1)  # what torch.cuda.graph_pool_handle() returns (it needs a GPU to make one)
    with pytest.raises(TypeError, match=r"got tuple; torch.cuda.graph_pool_handle\(\) .* pool = torch.cuda.MemPool\(\) .* pool=pool.id"):
        bg.BreakableCUDAGraph(pool=handle)


@pytest.mark.parametrize("pool", [42, "pool", object()])
def test_a_pool_that_is_not_a_mempool_is_refused(pool):
    with pytest.raises(TypeError, match=r"expected a torch.cuda.MemPool \(a BreakableCUDAGraph's or GraphRunner's .pool\)"):
        bg.BreakableCUDAGraph(pool=pool)
    with pytest.raises(TypeError, match="expected a torch.cuda.MemPool"):
        bg.graphed(lambda x: x, torch.ones(2), pool=pool)


def test_the_capture_device_is_found_in_dataclass_and_object_arguments_too():
    @dataclasses.dataclass
    class Batch:
        x: object

    on_the_second_gpu = mock.MagicMock(spec=torch.Tensor, is_cuda=True, device=torch.device("cuda", 1))
    tensors = _tensors_to_refill(lambda batch: None, (Batch(on_the_second_gpu),), {})
    assert _device_of(tensors) == torch.device("cuda", 1)  # not the current device


def test_an_option_name_the_function_declares_too_is_refused_as_ambiguous():
    def step(x, measure_memory=False):
        return x * 2

    with pytest.raises(TypeError, match=r"measure_memory=, which is both an option of breakgraph's capture and an "
                                        r"argument of .*step: give the option as options=bg.CaptureOptions\(measure_memory=...\)"):
        bg.graphed(step, torch.ones(2), measure_memory=True)
