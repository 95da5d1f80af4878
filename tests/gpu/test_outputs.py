"""The output rule on the GPU, for graphed, the runner and the with block: refused, warned or refreshed
as tests/test_outputs.py finds it without one, and the next capture works after a refusal."""

import warnings

import numpy as np
import pytest
import torch

import breakgraph as bg
from tests.helpers import poison_

DEV = "cuda"


def frozen_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, bg.FrozenOutputWarning)]


def tensors_and_a_count(x):
    return {"h": torch.relu(x) * 2, "rows": x.shape[0]}


def test_graphed_refuses_a_set_and_an_array_and_captures_again_after():
    x = torch.randn(4, 8, device=DEV)
    with pytest.raises(TypeError, match=r"returned an object of type set at output, which a replay cannot refresh"):
        bg.graphed(lambda x: {x.shape[0]}, x)
    with pytest.raises(TypeError, match=r"returned an object of type ndarray at output\[1\]"):
        bg.graphed(lambda x: (x * 2, np.ones(2)), x)
    step = bg.graphed(lambda x: torch.tanh(x) + 1, x)
    for _ in range(5):
        x.copy_(torch.randn_like(x))
        poison_(step.output)
        torch.testing.assert_close(step(), torch.tanh(x) + 1)


def test_graphed_warns_of_a_number_and_refreshes_the_tensors_beside_it():
    x = torch.randn(4, 8, device=DEV)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = bg.graphed(tensors_and_a_count, x)
    (message,) = frozen_warnings(caught)
    assert "tensors_and_a_count() returned 4 (int) at output['rows']" in message
    (warned,) = [w for w in caught if issubclass(w.category, bg.FrozenOutputWarning)]
    assert warned.filename == __file__  # the user's line, not breakgraph's
    for _ in range(5):
        x.copy_(torch.randn_like(x))
        poison_(step.output)
        out = step()
        torch.testing.assert_close(out["h"], torch.relu(x) * 2)
        assert out["rows"] == 4


def test_a_runner_refuses_a_generator_at_capture_and_warns_of_a_number():
    buffer = torch.zeros(8, 16, device=DEV)
    runner = bg.GraphRunner(lambda x: (x * 3, (row for row in x)), buffer, capture_sizes=[4, 8], progress=False)
    with pytest.raises(TypeError, match=r"<lambda>\(\) returned an object of type generator at output\[1\]"):
        runner.capture()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        counted = bg.GraphRunner(tensors_and_a_count, buffer, capture_sizes=[4, 8], progress=False).capture()
    assert any("returned 8 (int) at output['rows']" in message for message in frozen_warnings(caught))
    for n in (3, 8, 5, 4):
        x = torch.randn(n, 16, device=DEV)
        out = counted(x)
        torch.testing.assert_close(out["h"], torch.relu(x) * 2)
        poison_(out["h"])  # the next call of this size must write it again


def test_a_break_in_the_with_block_is_held_to_the_rule():
    @bg.eager_on_graph
    def seen_rows(x):
        return {x.shape[0]}

    @bg.eager_on_graph
    def with_an_array(x):
        return x * 2, x.cpu().numpy()

    @bg.eager_on_graph
    def counted(x):
        return [x.sum(0), int(x.shape[0])], x.shape[0]

    x = torch.randn(4, 8, device=DEV)
    for refused, where in ((seen_rows, r"seen_rows\(\) returned an object of type set at out,"), (with_an_array, r"with_an_array\(\) returned an object of type ndarray at out\[1\],")):
        graph = bg.BreakableCUDAGraph()
        with pytest.raises(TypeError, match=where):
            with bg.BreakableCUDAGraphCapture(graph):
                refused(x + 1)
    graph = bg.BreakableCUDAGraph()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with bg.BreakableCUDAGraphCapture(graph):
            (total, rows), frozen = counted(x + 1)
            y = total * 3
    (message,) = frozen_warnings(caught)
    assert "counted() returned 4 (int) at out[1]; a replay runs the break again" in message
    assert frozen == 4 and rows == 4
    for _ in range(5):
        x.copy_(torch.randn_like(x))
        poison_(y)
        graph.replay()
        torch.testing.assert_close(y, (x + 1).sum(0) * 3)
