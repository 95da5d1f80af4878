"""CUDA's and torch's bare refusals during capture become errors that name the user's line and the remedy."""

import pytest

from breakgraph.dispatch import UncapturableOpError, clearer_error, is_capture_violation, is_random_op_refusal

CAPTURE_REFUSALS = [
    "CUDA error: operation not permitted when stream is capturing",
    "CUDA error: operation failed due to a previous error during capture",
    "cudaErrorStreamCaptureUnsupported: operation not permitted when stream is capturing",
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


def test_other_errors_and_clear_ones_are_left_alone():
    assert clearer_error(raised("shape mismatch"), "graph") is None
    assert clearer_error(ValueError("operation not permitted when stream is capturing"), "graph") is None
    assert clearer_error(UncapturableOpError("already clear"), "graph") is None
