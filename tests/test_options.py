"""Every option is checked where it is given, the same way with a GPU and without, and the
message names the option, the value given and what is allowed."""

import functools
import subprocess
import sys
import warnings

import pytest
import torch

import breakgraph as bg


def quiet_runner(fn, inputs, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the no-GPU fallback's note
        return bg.GraphRunner(fn, inputs, **options)


def test_eager_on_graph_refuses_an_enable_that_is_not_a_bool():
    with pytest.raises(TypeError, match=r"eager_on_graph\(enable=...\) must be True or False, got 'no' \(str\)"):
        bg.eager_on_graph(enable="no")
    with pytest.raises(TypeError, match=r"got 0 \(int\)"):
        bg.eager_on_graph(lambda x: x, enable=0)


def test_eager_on_graph_refuses_a_misspelt_keyword_naming_the_closest():
    with pytest.raises(TypeError, match="eager_on_graph got an unknown option 'enabled'; did you mean 'enable'"):
        bg.eager_on_graph(enabled=False)
    with pytest.raises(TypeError, match="eager_on_graph got an unknown option 'stub'; it takes function, enable, inline, capture_stub"):
        bg.eager_on_graph(lambda x: x, stub=print)


@pytest.mark.parametrize("name, value", [("lazy", "no"), ("clone", "yes"), ("progress", "no"), ("share_executables", 1)])
def test_runner_switches_take_bools_only(name, value):
    with pytest.raises(TypeError, match=f"{name} must be True or False, got {value!r}"):
        quiet_runner(lambda x: x, torch.zeros(4, 2), **{name: value})


def test_runner_pad_value_is_a_number_without_a_gpu_too():
    with pytest.raises(TypeError, match=r"pad_value must be a number \(int or float\), got 'zero' \(str\)"):
        quiet_runner(lambda x: x, torch.zeros(4, 2), pad_value="zero")
    with pytest.raises(TypeError, match="pad_value must be a number"):
        quiet_runner(lambda x: x, torch.zeros(4, 2), pad_value=True)
    assert quiet_runner(lambda x: x, torch.zeros(4, 2), pad_value=-1.5).options.pad_value == -1.5


def test_runner_capture_sizes_must_be_a_list():
    with pytest.raises(TypeError, match=r"capture_sizes must be a list of batch sizes .* got 8; for one size write \[8\]"):
        quiet_runner(lambda x: x, torch.zeros(8, 2), capture_sizes=8)
    assert quiet_runner(lambda x: x, torch.zeros(8, 2), capture_sizes=range(1, 9)).sizes_by_key == {None: list(range(1, 9))}


def test_runner_refuses_an_option_it_does_not_take_naming_the_closest():
    with pytest.raises(TypeError, match="GraphRunner got an unknown option 'lazzy'; did you mean 'lazy'"):
        quiet_runner(lambda x: x, torch.zeros(4, 2), lazzy=True)
    with pytest.raises(TypeError, match="GraphRunner got an unknown option 'colour'; it takes"):
        quiet_runner(lambda x: x, torch.zeros(4, 2), colour="red")


def test_an_options_object_refuses_an_option_it_does_not_take_naming_the_closest():
    with pytest.raises(TypeError, match="CaptureOptions got an unknown option 'random_op'; did you mean 'random_ops'"):
        bg.CaptureOptions(random_op="break")
    with pytest.raises(TypeError, match="RunnerOptions got an unknown option 'lazzy'; did you mean 'lazy'"):
        bg.RunnerOptions(lazzy=True)
    with pytest.raises(TypeError, match="RunnerOptions got an unknown option 'breaks'; it takes"):
        bg.RunnerOptions(breaks="inline")  # a capture's option: a runner sets it through modes
    with pytest.raises(TypeError, match="takes 1 positional argument"):
        bg.CaptureOptions("graph")


def test_an_options_object_and_options_by_name_combine():
    options = bg.RunnerOptions(lazy=True, pad_value=3)
    runner = quiet_runner(lambda x: x, torch.zeros(4, 2), options=options, pad_value=7)
    assert runner.options.lazy and runner.options.pad_value == 7
    with pytest.raises(TypeError, match=r"GraphRunner\(options=...\) takes a breakgraph.RunnerOptions, got CaptureOptions"):
        quiet_runner(lambda x: x, torch.zeros(4, 2), options=bg.CaptureOptions())
    with pytest.raises(ValueError, match="breaks must be one of 'eager', 'inline', got 'full'"):
        bg.CaptureOptions(breaks="full")
    with pytest.raises(TypeError, match="barrier_fn must be callable or None, got 5"):
        bg.CaptureOptions(barrier_fn=5)


def test_runner_keys_and_key_fn_are_checked():
    with pytest.raises(TypeError, match="key_fn must be callable or None, got 'uniform'"):
        quiet_runner(lambda x, key: x, torch.zeros(4, 2), keys=["uniform"], key_fn="uniform")
    with pytest.raises(ValueError, match="keys must be distinct"):
        quiet_runner(lambda x, key: x, torch.zeros(4, 2), keys=["a", "a"], key_fn=lambda x: "a")
    with pytest.raises(TypeError, match="keys must be a non-empty list"):
        quiet_runner(lambda x, key: x, torch.zeros(4, 2), keys="ab", key_fn=lambda x: "a")


def test_a_key_the_runner_does_not_know_is_an_error_not_a_silent_eager_run():
    runner = quiet_runner(lambda x, key: x + 1, torch.zeros(4, 2), keys=["decode", "mixed"], key_fn=lambda x: "prefill")
    with pytest.raises(ValueError, match=r"key_fn returned \['prefill'\], but this runner's keys are \['decode', 'mixed'\]"):
        runner(torch.zeros(2, 2))


def test_a_meta_device_input_is_refused_with_or_without_a_gpu():
    with pytest.raises(ValueError, match="static input 0 is on the meta device, which holds no data"):
        quiet_runner(lambda x: x, torch.zeros(4, 2, device="meta"))


def test_runner_release_and_report_switches_are_checked():
    runner = quiet_runner(lambda x: x, torch.zeros(4, 2), progress=False)
    with pytest.raises(TypeError, match="keep_graphs must be True or False, got 'no'"):
        runner.release(keep_graphs="no")
    with pytest.raises(TypeError, match="print_table must be True or False, got 'no'"):
        runner.report(print_table="no")
    with pytest.raises(ValueError, match="probes must be a whole number >= 2"):
        runner.estimate_memory(probes=1)


def test_share_executables_takes_a_list_of_graphs():
    with pytest.raises(TypeError, match="share_executables takes a list of BreakableCUDAGraphs, got BreakableCUDAGraph"):
        bg.share_executables(bg.BreakableCUDAGraph())
    with pytest.raises(TypeError, match="item 0 is a int"):
        bg.share_executables([42])


def test_a_misspelt_graphed_option_is_refused_not_passed_to_the_function():
    def step(x, **kwargs):
        return x * 2

    with pytest.raises(TypeError, match=r"graphed\(\) got random_op=, which .*step does not declare .* option 'random_ops'"):
        bg.graphed(step, torch.ones(2), random_op="break")
    with pytest.raises(TypeError, match=r"option 'warmup'.*functools.partial"):
        bg.graphed(step, torch.ones(2), warmups=3)


def test_a_graphed_function_may_declare_an_argument_named_like_an_option():
    def step(x, warmups):
        return x * warmups

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the no-GPU fallback's note
        replayed = bg.graphed(step, torch.ones(2), warmups=3)
        bound = bg.graphed(functools.partial(lambda x, **kw: x * kw["warmups"], warmups=2), torch.ones(2))
    torch.testing.assert_close(replayed.replay(), torch.full((2,), 3.0))
    torch.testing.assert_close(bound.replay(), torch.full((2,), 2.0))


def test_a_python_number_in_a_graphed_output_is_said_to_be_frozen():
    def step(x):
        return x + 1, x.shape[0]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bg.graphed(step, torch.ones(3))
    frozen = [w for w in caught if issubclass(w.category, bg.FrozenOutputWarning)]
    assert len(frozen) == 1
    assert "step() returned 3 (int) at output[1]; a replay re-runs GPU work only, so a graph returns the capture-time value at every replay" in str(frozen[0].message)


def test_graphed_options_are_checked_like_the_context_managers():
    with pytest.raises(ValueError, match="random_ops must be one of"):
        bg.graphed(lambda x: x, torch.ones(2), random_ops="skip")
    with pytest.raises(TypeError, match="debug must be True, False or None"):
        bg.graphed(lambda x: x, torch.ones(2), debug="yes")


def test_version_flag_prints_breakgraphs_and_its_dependencies_versions():
    run = subprocess.run([sys.executable, "-m", "breakgraph", "--version"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"breakgraph {bg.__version__} (torch {torch.__version__}, cuda-bindings ")
