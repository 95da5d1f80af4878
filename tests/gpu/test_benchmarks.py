"""Every benchmark's --quick run: its variants pass their checks against eager and it writes its outputs."""

import importlib
import json

import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "name, outputs",
    [
        ("replay_overhead", ["replay_overhead"]),
        ("decode_step", ["decode_step"]),
        ("memory", ["memory"]),
        ("capture_time", ["capture_time", "capture_startup"]),
        ("training_step", ["training_step"]),
        ("soak", ["soak"]),
        ("graph_memory", ["graph_memory"]),
    ],
)
def test_benchmark_quick_run(name, outputs, tmp_path):
    pytest.importorskip("matplotlib")
    module = importlib.import_module(f"benchmarks.{name}")
    assert module.main(["--quick", "--out", str(tmp_path)]) == 0
    for output in outputs:
        data = json.loads((tmp_path / f"{output}.json").read_text())
        measured = [row for row in data["rows"] if row["variant"] != "ratios"]
        assert measured and any("breakgraph" in row["variant"] for row in measured)
        assert (tmp_path / f"{output}.png").stat().st_size > 0
