"""A runner's static inputs: live batches checked, copied in and padded, outputs cut to the live rows."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from breakgraph.serving.batches import StaticInputs, live_rows


@settings(max_examples=60, deadline=None)
@given(max_size=st.integers(1, 12), data=st.data())
def test_a_live_batch_fills_the_first_rows_and_the_rest_up_to_the_size_is_padding(max_size, data):
    n = data.draw(st.integers(1, max_size), label="live rows")
    size = data.draw(st.integers(n, max_size), label="captured size")
    pad = data.draw(st.sampled_from([0, -1, 2.5]), label="pad value")
    inputs = StaticInputs((torch.full((max_size, 3), 99.0), torch.full((max_size,), 99, dtype=torch.long)))
    live = [torch.randn(n, 3), torch.randint(0, 10, (n,))]
    inputs.fill(inputs.check(tuple(live)), size, pad)
    values, ids = inputs.leaves
    assert torch.equal(values[:n], live[0]) and torch.equal(ids[:n], live[1])
    assert torch.all(values[n:size] == pad) and torch.all(ids[n:size] == int(pad))
    assert torch.all(values[size:] == 99.0)  # rows above the size are not touched
    out = live_rows({"y": values[:size], "scalar": torch.tensor(1.0)}, size, n, clone=False)
    assert out["y"].shape[0] == n and out["y"].data_ptr() == values.data_ptr()
    assert out["scalar"].dim() == 0


@settings(max_examples=40, deadline=None)
@given(max_size=st.integers(2, 12), data=st.data())
def test_inputs_prepared_in_the_static_buffers_are_taken_as_they_are(max_size, data):
    n = data.draw(st.integers(1, max_size - 1), label="live rows")
    size = data.draw(st.integers(n, max_size), label="captured size")
    inputs = StaticInputs((torch.zeros(max_size, 3), torch.zeros(max_size, dtype=torch.long)))
    values, ids = inputs.leaves
    values[:n] = torch.randn(n, 3)  # written in place, as an engine does
    prepared, fresh_ids = values[:n].clone(), torch.randint(0, 10, (n,))
    # The values are the buffer's own rows; the ids are a tensor of their own, copied in.
    inputs.fill(inputs.check((values[:n], fresh_ids)), size, -1)
    assert torch.equal(values[:n], prepared) and torch.equal(ids[:n], fresh_ids)
    assert torch.all(values[n:size] == -1) and torch.all(ids[n:size] == -1)
    assert live_rows(values[:size], size, n, clone=False).shape[0] == n
    assert live_rows(values[:size], size, size, clone=False).shape[0] == size


def test_live_rows_clones_when_asked():
    static = torch.arange(8.0)
    out = live_rows(static[:4], 4, 3, clone=True)
    assert torch.equal(out, torch.arange(3.0)) and out.data_ptr() != static.data_ptr()


@dataclasses.dataclass
class _Scores:
    logits: torch.Tensor
    hidden: list


class _Plain:
    def __init__(self, logits):
        self.logits = logits


def test_live_rows_cuts_and_clones_the_tensors_inside_dataclasses_and_objects():
    static = torch.arange(16.0).reshape(8, 2)
    for output in (_Scores(static, [static, "kept"]), _Plain(static)):
        out = live_rows(output, 8, 3, clone=True)
        assert type(out) is type(output) and out is not output and output.logits is static
        assert torch.equal(out.logits, static[:3]) and out.logits.data_ptr() != static.data_ptr()
    scores = live_rows(_Scores(static, [static, "kept"]), 8, 3, clone=False)
    assert scores.hidden[0].shape == (3, 2) and scores.hidden[0].data_ptr() == static.data_ptr() and scores.hidden[1] == "kept"


def test_live_inputs_that_do_not_fit_the_buffers_are_named():
    inputs = StaticInputs({"ids": torch.zeros(4, 2, dtype=torch.long), "mask": torch.zeros(4, 2)})
    with pytest.raises(TypeError, match="pass live inputs by keyword"):
        inputs.live((torch.zeros(1, 2),), {})
    with pytest.raises(ValueError, match=r"expected inputs \['ids', 'mask'\], got \['ids'\]"):
        inputs.check({"ids": torch.zeros(1, 2, dtype=torch.long)})
    with pytest.raises(ValueError, match="dtype torch.float32, static buffer has torch.int64"):
        inputs.check({"ids": torch.zeros(1, 2), "mask": torch.zeros(1, 2)})
    with pytest.raises(ValueError, match="input 1: 2 rows, but input 0 has 1"):
        inputs.check({"ids": torch.zeros(1, 2, dtype=torch.long), "mask": torch.zeros(2, 2)})
    assert inputs.arguments({"ids": 1, "mask": 2}, {"key": "k"}) == ((), {"ids": 1, "mask": 2, "key": "k"})


def test_buffers_on_the_meta_device_or_off_the_gpu_are_refused_where_it_matters():
    with pytest.raises(ValueError, match="static input 1 is on the meta device"):
        StaticInputs((torch.zeros(2), torch.zeros(2, device="meta"))).refuse_meta()
    with pytest.raises(ValueError, match="static input 0 is on cpu, but a graph replays only CUDA work"):
        StaticInputs(torch.zeros(2)).require_cuda()


def _outcome(check, inputs):
    try:
        return [id(live) for live in check(inputs)]
    except (TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"


@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_the_one_pass_check_answers_as_the_leaf_by_leaf_check_does(data):
    inputs = StaticInputs((torch.zeros(8, 3), torch.zeros(8, dtype=torch.long)))
    n = data.draw(st.integers(0, 9), label="rows")
    candidates = {
        "fits": lambda: torch.randn(n, 3),
        "other rows": lambda: torch.randn(max(n - 1, 0), 3),
        "other trailing shape": lambda: torch.randn(n, 4),
        "other dtype": lambda: torch.randn(n, 3, dtype=torch.float64),
        "0-dim": lambda: torch.tensor(1.0),
        "not a tensor": lambda: [[0.0] * 3] * n,
    }
    first = candidates[data.draw(st.sampled_from(sorted(candidates)), label="first input")]()
    second = data.draw(st.sampled_from([torch.zeros(n, dtype=torch.long), torch.zeros(n), torch.zeros(n, 2, dtype=torch.long)]), label="second input")
    count = data.draw(st.sampled_from([1, 2, 3]), label="inputs given")
    given_inputs = (first, second, second)[:count]
    assert _outcome(inputs.check, given_inputs) == _outcome(inputs._check_leaf_by_leaf, given_inputs)


def test_an_input_inside_a_buffer_is_copied_as_copy_copies_it_and_negative_zero_pads_as_given():
    inputs = StaticInputs((torch.arange(8.0), torch.zeros(8, dtype=torch.long)))
    values, ids = inputs.leaves
    with pytest.raises(RuntimeError, match="refer to a single memory location"):  # torch's own refusal, not a silent mix
        inputs.fill(inputs.check((values[1:4], torch.ones(3, dtype=torch.long))), 4, 0)
    inputs.fill(inputs.check((torch.ones(2), torch.ones(2, dtype=torch.long))), 4, -0.0)
    assert torch.signbit(values[2:4]).all() and torch.equal(ids[2:4], torch.zeros(2, dtype=torch.long))
