"""Every benchmark's --quick run: its variants pass their checks against eager and it writes its outputs.

Where Meta's library (the ``bench`` extra) is installed, the benchmarks that
measure it have its row and name it in their ratios.
"""

import importlib
import importlib.util
import json
import sys

import pytest

from benchmarks.peers import META, MISSING


META_INSTALLED = importlib.util.find_spec("breakable_cuda_graphs") is not None


@pytest.mark.parametrize(
    "name, outputs, measures_meta",
    [
        ("replay_overhead", ["replay_overhead"], True),
        ("decode_step", ["decode_step"], True),
        ("memory", ["memory"], True),
        ("capture_time", ["capture_time", "capture_startup"], True),
        ("training_step", ["training_step"], True),
        ("soak", ["soak"], False),
        ("graph_memory", ["graph_memory"], False),
        ("transformers_generate", ["transformers_generate"], False),
    ],
)
def test_benchmark_quick_run(name, outputs, measures_meta, tmp_path):
    pytest.importorskip("matplotlib")
    if name == "transformers_generate":
        pytest.importorskip("transformers", reason="the transformers extra is not installed")
    module = importlib.import_module(f"benchmarks.{name}")
    assert module.main(["--quick", "--out", str(tmp_path)]) == 0
    for output in outputs:
        data = json.loads((tmp_path / f"{output}.json").read_text())
        measured = [row for row in data["rows"] if row["variant"] != "ratios"]
        assert measured and any("breakgraph" in row["variant"] for row in measured)
        assert (tmp_path / f"{output}.png").stat().st_size > 0
        if measures_meta and META_INSTALLED:
            assert any(row["variant"] == META for row in measured), f"{output}: no {META!r} row"
            ratios = [str(value) for row in data["rows"] if row["variant"] == "ratios" for value in row.values()]
            assert any("meta/" in value for value in ratios), f"{output}: no meta/ ratio"


def test_without_meta_s_library_a_benchmark_says_why_and_measures_the_rest(monkeypatch, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    monkeypatch.setitem(sys.modules, "breakable_cuda_graphs", None)  # importing it raises ImportError
    module = importlib.import_module("benchmarks.replay_overhead")
    assert module.main(["--quick", "--out", str(tmp_path)]) == 0
    assert MISSING in capsys.readouterr().out
    variants = {row["variant"] for row in json.loads((tmp_path / "replay_overhead.json").read_text())["rows"]}
    assert META not in variants and {"breakgraph replay", "torch CUDAGraph per segment"} <= variants
