"""The benchmarks' peer, Meta's library: loaded where installed, skipped with its reason where not."""

import sys
import types

from benchmarks.peers import MISSING, load_meta


def test_the_installed_library_is_what_load_meta_returns(monkeypatch):
    library = types.ModuleType("breakable_cuda_graphs")
    monkeypatch.setitem(sys.modules, "breakable_cuda_graphs", library)
    assert load_meta() is library


def test_without_the_library_load_meta_prints_why_and_returns_none(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "breakable_cuda_graphs", None)  # importing it raises ImportError
    assert load_meta() is None
    printed = capsys.readouterr().out
    assert MISSING in printed and "pip install -e '.[bench]'" in printed
