"""GraphRunner without a GPU: argument checks and the eager fallback."""

import warnings

import pytest
import torch

import breakgraph as bg
from breakgraph.base.runtime import cuda_available


@pytest.mark.filterwarnings("ignore:breakgraph. no CUDA GPU is available")  # these runners are only made
def test_keys_select_in_priority_order_without_capturing():
    runner = bg.GraphRunner(
        lambda x, key: x,
        torch.zeros(8, 2),
        capture_sizes={"uniform": [1, 2], "mixed": [4, 8]},
        keys=["uniform", "mixed"],
        key_fn=lambda x: ["uniform", "mixed"],
        progress=False,
    )
    assert runner.select(2, ["uniform", "mixed"]) == ("uniform", 2)
    assert runner.select(3, ["uniform", "mixed"]) == ("mixed", 4)
    assert runner.select(9, ["uniform", "mixed"]) is None
    assert runner.select(1, ["mixed"]) == ("mixed", 4)


def test_runner_argument_errors():
    with pytest.raises(ValueError, match="disagree"):
        bg.GraphRunner(lambda a, b: a, (torch.zeros(4, 2), torch.zeros(5, 2)))
    with pytest.raises(ValueError, match="together"):
        bg.GraphRunner(lambda a: a, torch.zeros(4, 2), keys=["a"])
    with pytest.raises(TypeError, match="batch dimension"):
        bg.GraphRunner(lambda a: a, torch.tensor(3.0))


@pytest.mark.skipif(cuda_available(), reason="checks the no-GPU fallback")
def test_runner_runs_eagerly_without_a_gpu():
    calls = []

    def fn(x, y):
        calls.append(x.shape[0])
        return x * 2 + y

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner = bg.GraphRunner(fn, (torch.zeros(16, 3), torch.zeros(16, 3))).capture()
    assert any("eagerly" in str(w.message) for w in caught)
    x, y = torch.randn(5, 3), torch.randn(5, 3)
    torch.testing.assert_close(runner(x, y), x * 2 + y)
    assert calls == [5]
    with pytest.raises(ValueError, match="does not fit"):
        runner(torch.randn(5, 4), torch.randn(5, 4))
    with pytest.raises(ValueError, match="n = 0"):
        runner(torch.randn(0, 3), torch.randn(0, 3))
    assert runner.report(print_table=False)["eager_reason"]


def test_wrong_inputs_are_named_not_crashed():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(TypeError, match="static_inputs must be a tensor"):
            bg.GraphRunner(lambda x: x, None)
        with pytest.raises(TypeError, match="static_inputs must be a tensor"):
            bg.GraphRunner(lambda x: x, 5)
        runner = bg.GraphRunner(lambda x: x * 2, torch.zeros(4, 3), progress=False)
        with pytest.raises(TypeError, match="expected a tensor whose dimension 0 is the batch, got list"):
            runner([1, 2, 3])
        with pytest.raises(ValueError, match="0-dim tensor"):
            runner(torch.tensor(1.0))
        with pytest.raises(TypeError, match="expected 1 input tensor, got 2"):
            runner(torch.zeros(2, 3), torch.zeros(2, 3))


@pytest.mark.skipif(cuda_available(), reason="checks the no-GPU message")
def test_graph_pool_without_a_gpu_says_so():
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        bg.BreakableCUDAGraph().pool


def test_runner_modes_are_checked():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="modes must be one of 'breakable', 'full', 'none', got 'fast'"):
            bg.GraphRunner(lambda x: x, torch.zeros(4, 2), modes="fast")
        with pytest.raises(ValueError, match=r"modes gives keys \['a'\], but this runner's keys \(keys=\) are \['a', 'b'\]"):
            bg.GraphRunner(lambda x, key: x, torch.zeros(4, 2), keys=["a", "b"], key_fn=lambda x: ["a"], modes={"a": "full"})
        with pytest.raises(ValueError, match=r"one key None, since it was made without keys=: give one mode for all"):
            bg.GraphRunner(lambda x: x, torch.zeros(4, 2), modes={"x": "full"})
        with pytest.raises(TypeError, match="modes must be one of"):
            bg.GraphRunner(lambda x: x, torch.zeros(4, 2), modes=["full"])
        runner = bg.GraphRunner(lambda x, key: x, torch.zeros(4, 2), keys=["a", "b"], key_fn=lambda x: ["a", "b"], modes={"a": "none", "b": "full"})
    assert runner.select(2, ["a", "b"]) == ("b", 2)  # a key with mode "none" has no graphs


def test_capture_refuses_keys_the_runner_does_not_have():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner = bg.GraphRunner(lambda x, key: x, torch.zeros(4, 2), keys=["a", "b"], key_fn=lambda x: ["a"], progress=False)
    with pytest.raises(ValueError, match=r"keys \['c'\] are not this runner's; its keys are \['a', 'b'\]"):
        runner.capture(keys=["a", "c"])
    with pytest.raises(TypeError, match="keys must be a list of this runner's keys, got 'a'"):
        runner.capture(keys="a")


def test_capture_refuses_sizes_the_runner_does_not_have():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner = bg.GraphRunner(lambda x, key: x, torch.zeros(8, 2), {"a": [1, 4], "b": [2, 8]}, keys=["a", "b"], key_fn=lambda x: ["a"])
    with pytest.raises(ValueError, match=r"sizes \[2\] are not this runner's; its sizes are \[1, 4\]"):
        runner.capture(keys=["a"], sizes=[4, 2])
    with pytest.raises(TypeError, match="sizes must be a list of this runner's batch sizes, got 4"):
        runner.capture(sizes=4)
    runner.capture(sizes=[2, 4])  # each key captures those of its sizes


def test_memory_planning_arguments_are_checked():
    with pytest.raises(TypeError, match="share_executables must be True or False"):
        bg.GraphRunner(lambda x: x, torch.zeros(4, 2), share_executables="yes")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner = bg.GraphRunner(lambda x: x, torch.zeros(4, 2), progress=False)
    with pytest.raises(ValueError, match="while_released must be one of 'eager', 'raise', got 'sleep'"):
        runner.release(while_released="sleep")
    with pytest.raises(RuntimeError, match="not released"):
        runner.restore()
    assert runner.memory() == {"pool_bytes": 0, "executable_bytes": 0, "total_bytes": 0}


@pytest.mark.skipif(cuda_available(), reason="the eager path of a machine without a GPU")
def test_without_a_gpu_release_and_restore_keep_their_contract_and_the_estimate_is_zero():
    """An engine's sleep and wake-up code runs unchanged on the eager path: nothing to free or
    measure, but a release still decides what calls do until the restore."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner = bg.GraphRunner(lambda x: x * 2, torch.zeros(4, 2), progress=False).capture()
    estimate = runner.estimate_memory()
    assert (estimate.pool_bytes, estimate.executable_bytes, estimate.total_bytes, estimate.probed_sizes) == (0, 0, 0, ())
    x = torch.randn(3, 2)
    freed = runner.release(while_released="raise")
    assert freed["freed_bytes"] == 0 and freed["seconds"] >= 0 and runner.released
    with pytest.raises(RuntimeError, match="released"):
        runner(x)
    with pytest.raises(RuntimeError, match="released already"):
        runner.release()
    with pytest.raises(RuntimeError, match="released .* call runner.restore"):
        runner.capture()
    taken = runner.restore()
    assert taken["taken_bytes"] == 0 and not runner.released
    torch.testing.assert_close(runner(x), x * 2)
    runner.release()  # while_released="eager": calls go on, eagerly
    torch.testing.assert_close(runner(x), x * 2)
    runner.restore()


def test_a_dropped_runner_dies_at_once_not_at_a_later_garbage_collection():
    """Its pool must be let go where the drop happens: a collection that frees it later can fall
    inside another library's capture, where destroying a pool aborts the process."""
    import gc
    import weakref

    gc.disable()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runner = bg.GraphRunner(lambda x: x * 2, torch.zeros(4, 2), progress=False)
            runner(torch.ones(3, 2))
            step = bg.graphed(lambda x: x + 1, torch.zeros(2))
        alive = [weakref.ref(runner), weakref.ref(step), weakref.ref(bg.BreakableCUDAGraph())]
        del runner, step
        assert [ref() for ref in alive] == [None, None, None], "a reference cycle keeps it for the collector"
    finally:
        gc.enable()
