"""The context-manager form's argument checks and its refusal where it cannot capture (no GPU needed)."""

import pytest
import torch

import breakgraph as bg
from breakgraph.base.runtime import cuda_available

no_gpu = pytest.mark.skipif(cuda_available(), reason="checks the no-GPU refusal")


def test_bad_arguments_are_rejected_before_anything_starts():
    with pytest.raises(ValueError, match="capture_error_mode"):
        bg.BreakableCUDAGraphCapture(bg.BreakableCUDAGraph(), capture_error_mode="strict")
    with pytest.raises(TypeError, match="BreakableCUDAGraph"):
        bg.BreakableCUDAGraphCapture(object())
    for stream in ("side", torch.Stream(device="cpu")):  # a GPU's torch.Stream is taken: tests/gpu/test_streams.py
        with pytest.raises(TypeError, match="stream must be a torch.cuda.Stream, a GPU's torch.Stream, or None; got (str 'side'|Stream)"):
            bg.BreakableCUDAGraphCapture(bg.BreakableCUDAGraph(), stream=stream)
    with pytest.raises(ValueError, match="random_ops must be one of 'graph', 'break', 'error'"):
        bg.BreakableCUDAGraphCapture(bg.BreakableCUDAGraph(), random_ops="ignore")
    with pytest.raises(ValueError, match="random_ops must be one of 'graph', 'break', 'error'"):
        bg.GraphRunner(lambda x: x, torch.zeros(4, 2), random_ops="skip")
    with pytest.raises(TypeError, match="CUDA torch.Generator"):
        bg.BreakableCUDAGraphCapture(bg.BreakableCUDAGraph(), generators=[torch.Generator()])
    with pytest.raises(TypeError, match="CUDA torch.Generator"):
        bg.GraphRunner(lambda x: x, torch.zeros(4, 2), generators=[7])
    with pytest.raises(ValueError, match="warmup"):
        bg.GraphRunner(lambda x: x, torch.zeros(4, 2), warmup="sometimes")


@no_gpu
def test_context_form_without_cuda_points_to_callable_form():
    graph = bg.BreakableCUDAGraph()
    with pytest.raises(RuntimeError, match="graphed"):
        with bg.BreakableCUDAGraphCapture(graph):
            pass
    assert not bg.is_capturing() and not graph.captured


def test_disable_env_refuses_context(monkeypatch):
    monkeypatch.setenv("BREAKGRAPH_DISABLE", "1")
    with pytest.raises(RuntimeError, match="BREAKGRAPH_DISABLE"):
        with bg.BreakableCUDAGraphCapture(bg.BreakableCUDAGraph()):
            pass
    assert not bg.is_capturing()


def test_ending_or_aborting_a_capture_that_never_began_says_so():
    graph = bg.BreakableCUDAGraph()
    for step in (graph.capture_end, graph.capture_abort):
        with pytest.raises(RuntimeError, match="not capturing: call capture_begin"):
            step()


@pytest.mark.filterwarnings("ignore:breakgraph. no CUDA GPU is available")  # these runners are only made
def test_executable_memory_is_measured_only_when_asked():
    assert not bg.BreakableCUDAGraphCapture(bg.BreakableCUDAGraph()).options.measure_memory
    assert bg.BreakableCUDAGraphCapture(bg.BreakableCUDAGraph(), measure_memory=True).options.measure_memory
    assert not bg.GraphRunner(lambda x: x, torch.zeros(4, 2)).options.measure_memory  # measuring costs start-up
    assert bg.GraphRunner(lambda x: x, torch.zeros(4, 2), measure_memory=True).options.measure_memory
    with pytest.raises(TypeError, match="measure_memory must be True or False"):
        bg.GraphRunner(lambda x: x, torch.zeros(4, 2), measure_memory="yes")
    with pytest.raises(TypeError, match="measure_memory must be True or False"):  # "no" is not False
        bg.BreakableCUDAGraphCapture(bg.BreakableCUDAGraph(), measure_memory="no")
