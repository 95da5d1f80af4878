"""Process-wide switches and the import on a machine without a GPU."""

import subprocess
import sys
import warnings

import pytest

import breakgraph as bg
from breakgraph.base import runtime


def test_debug_env_switch(monkeypatch):
    monkeypatch.delenv("BREAKGRAPH_DEBUG", raising=False)
    assert runtime.debug_requested() is False and runtime.debug_requested(True) is True
    monkeypatch.setenv("BREAKGRAPH_DEBUG", "1")
    assert runtime.debug_requested() is True and runtime.debug_requested(False) is False
    assert bg.BreakableCUDAGraph().debug is True


def test_eager_fallback_reason_names_the_switch_as_it_was_set(monkeypatch):
    monkeypatch.setenv("BREAKGRAPH_DISABLE", "1")
    assert runtime.eager_fallback_reason() == "BREAKGRAPH_DISABLE=1 is set"
    monkeypatch.setenv("BREAKGRAPH_DISABLE", " Yes")
    assert runtime.eager_fallback_reason() == "BREAKGRAPH_DISABLE=Yes is set"


@pytest.mark.parametrize("value", ["2", "enable", "y"])
def test_a_switch_neither_on_nor_off_is_taken_as_off_with_a_warning(monkeypatch, value):
    monkeypatch.setenv("BREAKGRAPH_DISABLE", value)
    with pytest.warns(UserWarning, match=rf"BREAKGRAPH_DISABLE='{value}' is neither on \(1, true, yes, on\) nor off"):
        assert runtime.capture_disabled() is False


@pytest.mark.parametrize("value", ["", "0", "off", "No", "1", "TRUE"])
def test_a_switch_on_or_off_warns_of_nothing(monkeypatch, value):
    monkeypatch.setenv("BREAKGRAPH_DEBUG", value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert runtime.debug_requested() is (value.lower() in ("1", "true"))


def test_a_driver_that_cuda_bindings_cannot_use_is_explained(monkeypatch):
    import breakgraph_bindings as bindings

    def refuse():
        raise bindings.CudaError(35, "cudaGetDeviceCount")  # cudaErrorInsufficientDriver

    monkeypatch.setattr(runtime.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runtime.torch.version, "cuda", "12.8")
    monkeypatch.setattr(bindings, "probe_devices", refuse)
    runtime.cuda_problem.cache_clear()
    try:
        problem = runtime.eager_fallback_reason()
        assert "cudaErrorInsufficientDriver" in problem and "pip install 'cuda-bindings==12.*'" in problem
        assert not runtime.cuda_available()
    finally:
        monkeypatch.undo()
        runtime.cuda_problem.cache_clear()


@pytest.mark.parametrize(
    "torch_cuda, bindings_version, expected",
    [
        ("12.8", "13.5.0", "pip install 'cuda-bindings==12.*' (or breakgraph[cu12])"),
        ("13.0", "12.9.1", "pip install 'cuda-bindings==13.*' (or breakgraph[cu13])"),
        ("13.0", "13.3.1", None),
        ("12.8", "12.9.0", None),
        (None, "13.5.0", None),  # a CPU build of torch: nothing to match
    ],
)
def test_a_cuda_bindings_release_for_another_cuda_major_is_named(torch_cuda, bindings_version, expected):
    message = runtime.cuda_mismatch(torch_cuda, bindings_version)
    if expected is None:
        assert message is None
    else:
        assert expected in message and f"cuda-bindings {bindings_version} is for CUDA" in message


def test_a_mismatch_that_still_works_is_a_warning_not_an_eager_fallback(monkeypatch):
    import breakgraph_bindings as bindings

    monkeypatch.setattr(runtime.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runtime.torch.version, "cuda", "11.8")
    monkeypatch.setattr(bindings, "probe_devices", lambda: None)
    runtime.cuda_problem.cache_clear()
    try:
        with pytest.warns(UserWarning, match=r"built for CUDA 11.8.*pip install 'cuda-bindings==11.\*'"):
            assert runtime.cuda_problem() is None
    finally:
        monkeypatch.undo()
        runtime.cuda_problem.cache_clear()


def test_import_without_gpu_in_a_fresh_process():
    run = subprocess.run([sys.executable, "-c", "import breakgraph; print('ok')"], capture_output=True, text=True)
    assert run.stdout.strip() == "ok", run.stderr


class _Stream:
    """Stands for a torch.cuda.Stream: claims only read its handle."""

    def __init__(self, handle: int):
        self.cuda_stream = handle


def _claim_from_another_thread(stream) -> BaseException | None:
    import threading

    outcome = []

    def claim():
        try:
            with runtime.claim_capture_stream(None, stream):
                outcome.append(None)
        except BaseException as error:
            outcome.append(error)

    thread = threading.Thread(target=claim, name="other-capture")
    thread.start()
    thread.join()
    return outcome[0]


def test_a_stream_is_held_by_one_thread_at_a_time_and_released_at_the_end():
    stream = _Stream(0x1234)
    with runtime.claim_capture_stream(None, stream) as claimed:
        assert claimed is stream
        with runtime.claim_capture_stream(None, stream):  # the holder may claim it again
            pass
        error = _claim_from_another_thread(stream)  # still held: the outer claim goes on
        assert isinstance(error, RuntimeError)
        assert "0x1234 is already being captured on by another capture (thread 'MainThread')" in str(error)
        assert "stream of its own" in str(error)
    assert _claim_from_another_thread(stream) is None  # released


def test_a_failed_claim_leaves_the_stream_to_its_holder():
    stream = _Stream(0x5678)
    with runtime.claim_capture_stream(None, stream):
        assert isinstance(_claim_from_another_thread(stream), RuntimeError)
        assert isinstance(_claim_from_another_thread(stream), RuntimeError)
    assert _claim_from_another_thread(stream) is None


def test_captures_without_a_stream_take_breakgraphs_own_one_per_capture_at_once(monkeypatch):
    """No ``stream=``: a capture takes one of breakgraph's own streams that no capture holds,
    a new one only while every one is held, and the same one again once it is free."""
    import threading

    import torch

    made = []
    monkeypatch.setattr(runtime, "own_stream", lambda device: made.append(_Stream(0x9000 + len(made))) or made[-1])
    monkeypatch.setattr(runtime, "_own_streams", {})
    device = torch.device("cuda", 0)
    holding, release, taken = threading.Event(), threading.Event(), []

    def other_capture():
        with runtime.claim_capture_stream(device) as stream:
            taken.append(stream)
            holding.set()
            release.wait()

    with runtime.claim_capture_stream(device) as first:
        thread = threading.Thread(target=other_capture)
        thread.start()
        holding.wait()  # both held now
        release.set()
        thread.join()
    assert taken[0] is not first and made == [first, taken[0]]
    with runtime.claim_capture_stream(device) as again:
        assert again is first  # free again: taken, not made
    assert len(made) == 2 and not runtime._claims
