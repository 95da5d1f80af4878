"""The output rule (breakgraph.outputs), without a GPU: the same refusals and warnings a capture gives."""

import dataclasses
import enum
import warnings

import numpy as np
import pytest
import torch

import breakgraph as bg
from breakgraph.recording.outputs import check_output
from breakgraph.base.runtime import cuda_available

no_gpu = pytest.mark.skipif(cuda_available(), reason="checks the no-GPU fallback (tests/gpu/test_outputs.py checks the GPU)")


class Mode(enum.Enum):
    DECODE = 1


@dataclasses.dataclass
class Result:
    out: torch.Tensor
    seen: object


class Slotted:
    __slots__ = ("out",)

    def __init__(self):
        self.out = torch.ones(1)


def frozen_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, bg.FrozenOutputWarning)]


def checked(output, **options) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_output("step", output, **options)
    return frozen_warnings(caught)


@pytest.mark.parametrize(
    "output, kind, where",
    [
        ({1.0}, "set", "output"),
        ((torch.ones(2), np.ones(3)), "ndarray", "output[1]"),
        ((i for i in range(3)), "generator", "output"),
        ({"h": [torch.ones(1), frozenset()]}, "frozenset", "output['h'][1]"),
        (Result(torch.ones(1), bytearray(b"rows")), "bytearray", "output.seen"),
        ((torch.ones(1), Slotted()), "Slotted", "output[1]"),
    ],
)
def test_what_a_replay_cannot_refresh_is_refused_with_its_path(output, kind, where):
    with pytest.raises(TypeError, match=rf"step\(\) returned an object of type {kind} at {where.replace('[', '.').replace(']', '.')}, which a replay cannot refresh"):
        check_output("step", output)


@pytest.mark.parametrize(
    "output, said",
    [
        ((torch.ones(1), 3), "returned 3 (int) at output[1];"),
        ({"note": "done"}, "returned 'done' (str) at output['note'];"),
        ([torch.ones(1), Mode.DECODE], "returned <Mode.DECODE: 1> (Mode) at output[1];"),
        (np.float32(0.5), f"returned {np.float32(0.5)!r} (float32) at output;"),
        ((torch.ones(1), np.bool_(True)), f"returned {np.bool_(True)!r} (bool) at output[1];"),
    ],
)
def test_numbers_strings_and_enums_are_kept_and_said_to_be_frozen(output, said):
    (message,) = checked(output)
    assert said in message and "a graph returns the capture-time value at every replay" in message


def test_one_warning_names_every_frozen_value_up_to_four():
    (message,) = checked((torch.ones(1), 1.0, 2.0, "a", b"b", 5, 6))
    assert "returned 1.0 (float) at output[1], 2.0 (float) at output[2], 'a' (str) at output[3], b'b' (bytes) at output[4] and 2 more;" in message


class Rows(dict):
    """A dict subclass: optree walks only the plain containers."""


def test_a_dict_or_list_subclass_is_refused_rather_than_left_stale():
    with pytest.raises(TypeError, match=r"returned a Rows at output\[0\], a subclass of dict whose items breakgraph does not walk.*plain dict \(dict\(value\)\)"):
        check_output("step", (Rows(h=torch.ones(1)), torch.ones(1)))


def test_a_tensor_without_storage_of_its_own_is_refused():
    with pytest.raises(TypeError, match=r"returned a tensor of layout torch.sparse_coo at output\['k'\], which a replay cannot refresh in place: return a dense tensor"):
        check_output("step", {"k": torch.eye(2).to_sparse()})
    with pytest.raises(TypeError, match=r"layout torch.sparse_coo at out, .*\.to_dense\(\)"):
        check_output("attention", torch.eye(2).to_sparse(), root="out", refreshed_values=True)


@pytest.mark.parametrize(
    "output",
    [
        None,
        torch.ones(2),
        (torch.ones(1), None, torch.float16, torch.device("cpu"), torch.Size([2])),
        {"layer_class": torch.nn.Linear, "act": torch.relu, "module": torch.nn.Linear(1, 1), "rows": slice(0, 2), "h": torch.ones(1)},
    ],
)
def test_tensors_none_and_what_a_capture_fixes_pass_silently(output):
    assert checked(output) == []


def test_a_breaks_values_that_writeback_replaces_pass_and_the_others_do_not():
    assert checked({"n": 3, "rows": [np.ones(2)], "meta": Result(torch.ones(1), {4})}, root="out", refreshed_values=True) == []
    (message,) = checked((torch.ones(1), 7), root="out", refreshed_values=True)
    assert "returned 7 (int) at out[1]; a replay runs the break again" in message
    with pytest.raises(TypeError, match=r"returned an object of type set at out, which a replay cannot refresh: a replay runs the break again"):
        check_output("attention", {1}, root="out", refreshed_values=True)


@no_gpu
def test_graphed_refuses_a_set_without_a_gpu_as_it_does_with_one():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the no-GPU fallback's note
        with pytest.raises(TypeError, match=r"returned an object of type set at output, which a replay cannot refresh"):
            bg.graphed(lambda x: {float(x.sum())}, torch.ones(3))
        with pytest.raises(TypeError, match=r"returned an object of type ndarray at output\[1\]"):
            bg.graphed(lambda x: (x * 2, x.numpy() * 2), torch.ones(3))


@no_gpu
def test_graphed_keeps_the_captures_numbers_without_a_gpu_as_a_graph_does():
    x = torch.ones(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = bg.graphed(lambda x: [x * 2, float(x.sum())], x)
    assert any("returned 3.0 (float) at output[1]" in message for message in frozen_warnings(caught))
    x.copy_(torch.full((3,), 5.0))
    out = step()
    torch.testing.assert_close(out[0], torch.full((3,), 10.0))  # the tensor refreshed
    assert out[1] == 3.0  # the number the capture's, as a graph's replay leaves it


@no_gpu
def test_replays_without_a_gpu_do_not_chain_autograd_history():
    layer = torch.nn.Linear(8, 8)  # its parameters require grad: the output has autograd history
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = bg.graphed(lambda x: layer(x).relu(), torch.randn(4, 8))
    captured = type(step.output.grad_fn).__name__
    for _ in range(10):
        out = step()
    assert type(out.grad_fn).__name__ == captured == "ReluBackward0"  # not a CopyBackwards per replay


@no_gpu
def test_a_runner_without_a_gpu_holds_its_first_output_to_the_rule():
    x = torch.zeros(8, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner = bg.GraphRunner(lambda x: (x + 1, {"rows": x.shape[0]}.keys()), x, capture_sizes=[8])
        with pytest.raises(TypeError, match=r"<lambda>\(\) returned an object of type dict_keys at output\[1\]"):
            runner(torch.zeros(2, 4))
        counted = bg.GraphRunner(lambda x: (x + 1, x.shape[0]), x, capture_sizes=[8])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        counted(torch.zeros(2, 4))
        counted(torch.zeros(3, 4))
    (message,) = frozen_warnings(caught)
    assert "returned 2 (int) at output[1]" in message


def test_static_arguments_without_a_tensor_are_refused():
    with pytest.raises(TypeError, match=r"none of .*<lambda>'s static arguments holds a tensor \(str\), so there is nothing to refill"):
        bg.graphed(lambda x: x, "not a tensor")
    with pytest.raises(TypeError, match=r"\(int, float\).*functools.partial"):
        bg.graphed(lambda n, scale: n * scale, 3, scale=0.5)


@no_gpu
def test_a_function_that_reads_its_tensors_from_a_closure_takes_no_static_arguments():
    weights = torch.ones(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = bg.graphed(lambda: weights * 2)
    weights.fill_(3.0)
    torch.testing.assert_close(step(), torch.full((2,), 6.0))


def test_a_transformers_output_with_its_cache_is_accepted():
    transformers = pytest.importorskip("transformers", reason="the transformers extra is not installed")
    from transformers.modeling_outputs import CausalLMOutputWithPast

    output = CausalLMOutputWithPast(logits=torch.ones(1, 2), past_key_values=transformers.DynamicCache())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cache's flags are frozen values, and transformers' own notes
        check_output("forward", output)  # the cache's layer class is no stale value: not refused
