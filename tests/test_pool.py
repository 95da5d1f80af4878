"""What a pool holds, read from the allocator's global snapshot and never from torch's per-pool one."""

import ast
from pathlib import Path

import pytest

import breakgraph as bg
from breakgraph import pool as pool_module
from breakgraph.pool import PoolUsage

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
