"""Process-wide switches and the import on a machine without a GPU."""

import subprocess
import sys

import breakgraph as bg
from breakgraph import runtime


def test_debug_env_switch(monkeypatch):
    monkeypatch.delenv("BREAKGRAPH_DEBUG", raising=False)
    assert runtime.debug_requested() is False and runtime.debug_requested(True) is True
    monkeypatch.setenv("BREAKGRAPH_DEBUG", "1")
    assert runtime.debug_requested() is True and runtime.debug_requested(False) is False
    assert bg.BreakableCUDAGraph().debug is True


def test_eager_fallback_reason_names_the_switch(monkeypatch):
    monkeypatch.setenv("BREAKGRAPH_DISABLE", "1")
    assert runtime.eager_fallback_reason() == "BREAKGRAPH_DISABLE=1 is set"


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


def test_cycle_collector_is_paused_and_restored_across_nested_holds():
    import gc

    assert gc.isenabled()
    with runtime.cycle_collector_paused():
        with runtime.cycle_collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_objects_released_during_a_capture_die_when_the_last_capture_ends():
    import weakref

    class Pool:
        pass

    with runtime.cycle_collector_paused():
        pool = Pool()
        alive = weakref.ref(pool)
        runtime.release_after_captures(pool)
        del pool
        assert alive() is not None  # parked: a capture is active
    assert alive() is None
    free = Pool()
    alive = weakref.ref(free)
    runtime.release_after_captures(free)
    del free
    assert alive() is None  # no capture active: nothing held


def test_import_without_gpu_in_a_fresh_process():
    run = subprocess.run([sys.executable, "-c", "import breakgraph; print('ok')"], capture_output=True, text=True)
    assert run.stdout.strip() == "ok", run.stderr
