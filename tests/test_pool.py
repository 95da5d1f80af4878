"""Pools: what they hold (read from the allocator's global snapshot, never from torch's
per-pool one), and when dropped ones die and give their memory back."""

import ast
import gc
from pathlib import Path

import pytest

import breakgraph as bg
from breakgraph.base import pool as pool_module
from breakgraph.base.pool import PoolUsage

ROOT = Path(__file__).resolve().parents[1]


class FakePool:
    """A MemPool as breakgraph may use it: its id, and a snapshot() that must never be called."""

    def __init__(self, pool_id):
        self.id = pool_id

    def snapshot(self):
        raise AssertionError("MemPool.snapshot() corrupts Python's heap past pool id 256: never call it")


def block(address, size, state="active_allocated"):
    return {"address": address, "size": size, "state": state}


SEGMENTS = [
    {"segment_pool_id": (0, 300), "address": 1000, "total_size": 512, "blocks": [block(1000, 256), block(1256, 256, "inactive")]},
    {"segment_pool_id": (0, 301), "address": 5000, "total_size": 1024, "blocks": [block(5000, 1024)]},
    {"segment_pool_id": (0, 300), "address": 9000, "total_size": 2048, "blocks": [block(9000, 2048)]},
    {"segment_pool_id": (0, 0), "address": 20000, "total_size": 4096, "blocks": [block(20000, 4096)]},
]


@pytest.fixture
def allocator(monkeypatch):
    calls = []
    monkeypatch.setattr(pool_module.torch.cuda, "MemPool", FakePool)
    monkeypatch.setattr(pool_module, "_allocator_segments", lambda: calls.append(1) or SEGMENTS)
    return calls


def test_usage_is_the_global_snapshot_filtered_by_pool_id(allocator):
    usage = PoolUsage.of(FakePool((0, 300)))
    assert usage.reserved_bytes == 512 + 2048
    assert usage.allocated_blocks() == {1000: 256, 9000: 2048}
    assert usage.holds(1256) and usage.holds(9000 + 2047)
    assert not usage.holds(5000) and not usage.holds(9000 + 2048) and not usage.holds(20000)
    assert bg.pool_bytes(FakePool((0, 301))) == 1024
    assert bg.pool_bytes(FakePool((0, 999))) == 0
    assert len(allocator) == 3  # one snapshot per look, however many questions it answers


@pytest.mark.parametrize("wrong", [None, 42, "pool"])
def test_pool_bytes_of_something_that_is_not_a_pool_says_what_it_needs(wrong):
    with pytest.raises(TypeError, match=r"expected a torch.cuda.MemPool \(a BreakableCUDAGraph's or GraphRunner's .pool\)"):
        bg.pool_bytes(wrong)


def _calls(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node


def test_no_code_asks_torch_for_one_pools_snapshot():
    """MemPool.snapshot() and memory_snapshot(mempool_id) release a reference to the pool id that
    they never took (PyTorch PR #196366): neither the library nor the benchmarks may call them."""
    offenders = []
    for path in sorted((ROOT / "breakgraph").rglob("*.py")) + sorted((ROOT / "benchmarks").rglob("*.py")):
        for call in _calls(ast.parse(path.read_text(), str(path))):
            name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
            per_pool = name == "memory_snapshot" and (call.args or any(k.arg == "mempool_id" for k in call.keywords))
            if name == "snapshot" or per_pool:
                offenders.append(f"{path.relative_to(ROOT)}:{call.lineno}")
    assert not offenders, offenders


def test_cycle_collector_is_paused_while_captures_run_and_restored_after_the_last():
    import gc

    assert gc.isenabled()
    with pool_module.captures_running():
        with pool_module.captures_running():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_pools_released_during_a_capture_die_when_the_last_capture_ends():
    import weakref

    class Pool:
        pass

    class Owner:
        def __init__(self):
            self.pool = Pool()

    with pool_module.captures_running():
        owner = Owner()
        alive = weakref.ref(owner.pool)
        pool_module.release_after_captures(owner, "pool")
        assert not hasattr(owner, "pool")
        assert alive() is not None  # parked: a capture is active
    assert alive() is None
    owner = Owner()
    alive = weakref.ref(owner.pool)
    pool_module.release_after_captures(owner, "pool")
    assert alive() is None  # no capture active: dropped at once
    pool_module.release_after_captures(owner, "pool")  # released twice: nothing left to drop


def test_a_pool_never_dies_while_another_thread_starts_a_capture():
    """The pool's destructor runs under the lock a capture takes to start, never beside it."""
    import threading

    events = []

    class Pool:
        def __del__(self):
            events.append("pool destroyed")

    class Owner:
        pool = None

    owner = Owner()
    owner.pool = Pool()
    entered = threading.Event()

    def capture():
        with pool_module.captures_running():
            events.append("capture active")
            entered.set()
        events.append("capture ended")

    with pool_module._lock:  # as if the pool's release had begun: the capture must wait for it
        thread = threading.Thread(target=capture)
        thread.start()
        assert not entered.wait(0.2)
        pool_module.release_after_captures(owner, "pool")
    thread.join()
    assert events == ["pool destroyed", "capture active", "capture ended"]


class FakeAllocator:
    """torch.cuda's calls that return dropped pools' memory, as a log of what they did."""

    def __init__(self, monkeypatch, devices=(0,)):
        self.log, self.routed = [], []
        monkeypatch.setattr(pool_module, "_dropped", False)
        monkeypatch.setattr(pool_module, "_devices", set(devices))
        monkeypatch.setattr(pool_module, "_routed_to", {device: f"pool of {device}" for device in devices})
        monkeypatch.setattr(pool_module.torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(pool_module.torch.cuda, "use_mem_pool", self.use_mem_pool)
        monkeypatch.setattr(pool_module.torch.cuda, "empty_cache", self.empty_cache)

    def empty_cache(self):
        # No collection may run while allocations are routed: a pool it destroyed would abort the process.
        assert not gc.isenabled()
        self.log.append(("empty_cache", tuple(self.routed)))

    def use_mem_pool(self, pool, device):
        import contextlib

        @contextlib.contextmanager
        def routing():
            self.routed.append(device)
            yield
            self.routed.remove(device)

        return routing()


class Owner:
    def __init__(self, log):
        self.pool = Pool(log)


class Pool:
    def __init__(self, log):
        self.log = log

    def __del__(self):
        self.log.append("pool destroyed")


def test_nothing_is_emptied_before_a_pool_has_died(monkeypatch):
    allocator = FakeAllocator(monkeypatch)
    with pool_module.captures_running():
        pass
    pool_module.return_dropped_memory()
    assert allocator.log == []


def test_a_dropped_pool_dies_then_dead_pools_cache_is_emptied_with_every_device_routed(monkeypatch):
    allocator = FakeAllocator(monkeypatch, devices=(0, 1))
    pool_module.release_after_captures(Owner(allocator.log), "pool")
    # Emptied while every device routes to a pool of its own: torch then frees only dead pools' blocks.
    assert allocator.log == ["pool destroyed", ("empty_cache", (0, 1))]


def test_a_pool_dropped_during_a_capture_dies_and_gives_back_when_the_last_capture_ends(monkeypatch):
    allocator = FakeAllocator(monkeypatch)
    owner = Owner(allocator.log)
    with pool_module.captures_running():
        with pool_module.captures_running():
            pool_module.release_after_captures(owner, "pool")
        assert allocator.log == []  # parked: no cudaFree while a capture runs
    assert allocator.log == ["pool destroyed", ("empty_cache", (0,))]


def test_every_capture_start_gives_back_what_dead_pools_cached_since(monkeypatch):
    allocator = FakeAllocator(monkeypatch)
    pool_module.release_after_captures(Owner(allocator.log), "pool")
    allocator.log.clear()
    with pool_module.captures_running():  # the user may have dropped a dead graph's outputs by now
        assert allocator.log == [("empty_cache", (0,))]


def test_a_capture_that_lets_no_pool_go_empties_nothing_as_it_ends(monkeypatch):
    allocator = FakeAllocator(monkeypatch)
    pool_module.release_after_captures(Owner(allocator.log), "pool")
    with pool_module.captures_running():
        allocator.log.clear()
    assert allocator.log == []  # the next capture start or graph drop gives back what is dropped meanwhile
