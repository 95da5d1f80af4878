"""The benchmarks' peer, Meta's library: loaded where installed, skipped with its reason where not."""

import sys
import types

import pytest
import torch

from benchmarks.decoder import AttentionMetadata, MetaBreakable, attention
from benchmarks.peers import META, MISSING, load_meta, meta_ratios


def test_the_installed_library_is_what_load_meta_returns(monkeypatch):
    library = types.ModuleType("breakable_cuda_graphs")
    monkeypatch.setitem(sys.modules, "breakable_cuda_graphs", library)
    assert load_meta() is library


def test_without_the_library_load_meta_prints_why_and_returns_none(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "breakable_cuda_graphs", None)  # importing it raises ImportError
    assert load_meta() is None
    printed = capsys.readouterr().out
    assert MISSING in printed and "pip install -e '.[bench]'" in printed


def test_meta_s_attention_break_writes_attention_s_result_into_its_buffer():
    """Outside a capture a ``@no_graph`` function runs as it is: the decoder's break in Meta's way
    hands the model what :func:`attention` returns, through the buffer the break writes."""
    library = pytest.importorskip("breakable_cuda_graphs", reason="Meta's library, the optional peer of the benchmarks, is not installed (pip install -e '.[bench]')")
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 8, generator=generator)
    k, v = torch.randn(2, 2, 2, 8, generator=generator)
    k_cache, v_cache = torch.randn(2, 2, 16, 2, 8, generator=generator)
    meta = AttentionMetadata(length=5)
    expected = attention(q, k, v, k_cache.clone(), v_cache.clone(), meta)
    got = MetaBreakable(library).attend(q, k, v, k_cache, v_cache, meta)
    torch.testing.assert_close(got, expected)


def test_meta_ratios_name_each_of_ours_only_where_meta_was_measured():
    assert meta_ratios({"breakgraph": 2.0}, {"breakgraph": 2.0}) == ""
    assert meta_ratios({META: 3.0}, {"breakgraph": 2.0, "full": 1.5}) == "; meta/breakgraph 1.50x; meta/full 2.00x"
    assert meta_ratios({META: 3.0}, {"it": 2.0}, digits=3) == "; meta/it 1.500x"
