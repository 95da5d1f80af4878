"""CUDA's and torch's bare refusals during capture become errors that name the user's line and the remedy."""

import pytest

import breakgraph_bindings as bindings
from breakgraph.recording.dispatch import (
    CaptureInvalidatedError,
    UncapturableOpError,
    clearer_error,
    is_capture_violation,
    is_random_op_refusal,
)

CAPTURE_REFUSALS = [
    "CUDA error: operation not permitted when stream is capturing",
    "cudaErrorStreamCaptureUnsupported: operation not permitted when stream is capturing",
    "CUDA error: operation would make the legacy stream depend on a capturing blocking stream",
]
# What a capture reports once something else invalidated it: torch's kernel-launch check,
# and the end of a segment (cudaErrorStreamCaptureInvalidated is 901).
INVALIDATIONS = [
    "CUDA error: operation failed due to a previous error during capture",
    "cudaStreamEndCapture: cudaErrorStreamCaptureInvalidated: operation failed due to a previous error during capture",
]
RANDOM_REFUSAL = "Attempt to increase offset for a CUDA generator not in capture mode."


def raised(message: str) -> RuntimeError:
    try:
        raise RuntimeError(message)  # the user's line, as far as the traceback shows
    except RuntimeError as error:
        return error


@pytest.mark.parametrize("message", CAPTURE_REFUSALS)
def test_a_capture_violation_names_the_line_and_says_to_mark_it_eager(message):
    error = raised(message)
    assert is_capture_violation(error)
    clearer = clearer_error(error, "graph")
    assert isinstance(clearer, UncapturableOpError)
    text = str(clearer)
    assert "raise RuntimeError(message)" in text and "test_dispatch.py" in text
    assert "cannot be captured in a CUDA graph segment" in text and "@breakgraph.eager_on_graph" in text


@pytest.mark.parametrize("mode, advice", [("error", "random_ops='graph'"), ("graph", "generators=")])
def test_a_random_op_refusal_says_what_fixes_it_in_each_mode(mode, advice):
    error = raised(RANDOM_REFUSAL)
    assert is_random_op_refusal(error)
    text = str(clearer_error(error, mode))
    assert f"random_ops={mode!r}" in text and advice in text


@pytest.mark.parametrize(
    "message",
    [
        "CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`",
        "CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasLtCreate(&handle)`",
        "cusolver error: CUSOLVER_STATUS_NOT_INITIALIZED, when calling `cusolverDnCreate(&handle)`. "
        "If you keep seeing this error, you may use `torch.backends.cuda.preferred_linalg_library()`",
    ],
)
def test_a_librarys_first_use_in_a_capture_says_to_run_the_code_once_eagerly_first(message):
    """torch's words when cuBLAS, cuBLASLt or cuSOLVER creates its handle inside a capture."""
    clearer = clearer_error(raised(message), "graph")
    assert isinstance(clearer, UncapturableOpError)
    text = str(clearer)
    assert "raise RuntimeError" in text and "first use in this thread" in text and "once eagerly first" in text
    assert clearer_error(raised("CUBLAS_STATUS_NOT_INITIALIZED"), "graph") is None  # not a handle's creation


def test_other_errors_and_clear_ones_are_left_alone():
    assert clearer_error(raised("shape mismatch"), "graph") is None
    assert clearer_error(ValueError("operation not permitted when stream is capturing"), "graph") is None
    assert clearer_error(UncapturableOpError("already clear"), "graph") is None


@pytest.mark.parametrize("message", INVALIDATIONS)
def test_a_capture_invalidated_from_outside_names_the_device_wide_synchronize_and_the_remedy(message):
    assert not is_capture_violation(raised(message))  # an invalidated capture refused no op of its own
    clearer = clearer_error(raised(message), "graph")
    assert isinstance(clearer, CaptureInvalidatedError) and not isinstance(clearer, UncapturableOpError)
    text = str(clearer)
    assert "invalidated from outside" in text and "torch.cuda.synchronize()" in text and "another thread" in text
    assert "thread_local" in text and "capture again" in text
    assert clearer_error(clearer, "graph") is None  # already clear


def test_the_end_of_an_invalidated_segment_is_told_apart_by_its_cuda_error():
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        pytest.skip("cuda-python is not installed")
    error = bindings.CudaError(int(cudart.cudaError_t.cudaErrorStreamCaptureInvalidated), "cudaStreamEndCapture")
    assert isinstance(clearer_error(error, "graph"), CaptureInvalidatedError)
