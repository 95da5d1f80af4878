"""The bindings layer without a GPU: error translation, modes, handle conversion."""

import pytest
from cuda.bindings import runtime as cudart

import breakgraph_bindings as bindings


def test_cuda_error_carries_code_name_and_text():
    error = bindings.CudaError(int(cudart.cudaError_t.cudaErrorStreamCaptureUnsupported), "cudaStreamSynchronize")
    assert error.code == 900
    assert error.name == "cudaErrorStreamCaptureUnsupported"
    assert error.text == "operation not permitted when stream is capturing"
    assert str(error) == (
        "cudaStreamSynchronize: cudaErrorStreamCaptureUnsupported: operation not permitted when stream is capturing"
    )


def test_unknown_code_is_named_not_crashed():
    error = bindings.CudaError(123456)
    assert "123456" in error.name


def test_check_unpacks_results_and_raises():
    ok = cudart.cudaError_t.cudaSuccess
    assert bindings.check((ok,)) is None
    assert bindings.check((ok, 5)) == 5
    assert bindings.check((ok, 5, 6)) == (5, 6)
    with pytest.raises(bindings.CudaError, match="cudaErrorInvalidValue"):
        bindings.check((cudart.cudaError_t.cudaErrorInvalidValue, None), "cudaSomething")


def test_failing_runtime_call_raises_cuda_error_without_a_gpu():
    if bindings.device_count() > 0:
        pytest.skip("this machine has a GPU")
    with pytest.raises(bindings.CudaError) as info:
        bindings.begin_capture(1234)
    assert info.value.name.startswith("cudaError")


@pytest.mark.parametrize("name, member", [("global", "GLOBAL"), ("thread_local", "THREAD_LOCAL"), ("relaxed", "RELAXED")])
def test_capture_mode_parse(name, member):
    assert bindings.CaptureMode.parse(name) is bindings.CaptureMode[member]
    assert bindings.CaptureMode.parse(bindings.CaptureMode[member]) is bindings.CaptureMode[member]


def test_capture_mode_rejects_unknown():
    with pytest.raises(ValueError, match="'global', 'thread_local' or 'relaxed'"):
        bindings.CaptureMode.parse("strict")


def test_stream_handle_conversions():
    class FakeTorchStream:
        cuda_stream = 0xBEEF

    handle = bindings.stream_handle(FakeTorchStream())
    assert int(handle) == 0xBEEF
    assert bindings.stream_handle(0xBEEF) is handle  # cached
    raw = cudart.cudaStream_t(7)
    assert bindings.stream_handle(raw) is raw
    with pytest.raises(TypeError, match="torch.cuda.Stream"):
        bindings.stream_handle("stream")


def test_bindings_do_not_import_torch():
    import subprocess
    import sys

    code = "import sys, breakgraph_bindings; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_graph_handle_is_destroyed_once_a_borrowed_one_never_and_neither_is_copied(monkeypatch):
    import copy
    import gc

    destroyed = []
    monkeypatch.setattr(bindings.Graph, "_destroy", staticmethod(destroyed.append))
    owned = bindings.Graph(cudart.cudaGraph_t(init_value=7))
    with pytest.raises(TypeError, match="cannot be copied"):
        copy.copy(owned)
    owned.destroy()
    owned.destroy()
    assert not owned.alive
    dropped = bindings.Graph(cudart.cudaGraph_t(init_value=8))
    borrowed = bindings.Graph.borrowed(9)
    del owned, dropped, borrowed
    gc.collect()
    assert [int(handle) for handle in destroyed] == [7, 8]  # the dropped one as it died, the borrowed one never
