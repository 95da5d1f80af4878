"""Every benchmark's --quick run: its variants pass their checks against eager and it writes its outputs,
cold figures included where it reports them; and the worked example's run on the GPU.

Where Meta's library (the ``bench`` extra) is installed, the benchmarks that
measure it have its row and name it in their ratios.
"""

import importlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from torch.nn.attention import SDPBackend

from benchmarks.peers import META, MISSING


META_INSTALLED = importlib.util.find_spec("breakable_cuda_graphs") is not None


@pytest.mark.parametrize(
    "name, outputs, measures_meta",
    [
        ("replay_overhead", ["replay_overhead"], True),
        ("memory", ["memory"], True),
        ("capture_time", ["capture_time", "capture_startup"], True),
        ("training_step", ["training_step"], True),
        ("conditional", ["conditional"], True),
        ("soak", ["soak"], False),
        ("graph_memory", ["graph_memory"], False),
    ],
)
def test_benchmark_quick_run(name, outputs, measures_meta, tmp_path):
    pytest.importorskip("matplotlib")
    quick_run(name, tmp_path)
    for output in outputs:
        check_outputs(tmp_path, output, measures_meta)


def quick_run(name: str, out: Path) -> Path:
    module = importlib.import_module(f"benchmarks.{name}")
    assert module.main(["--quick", "--out", str(out)]) == 0
    return out


def check_outputs(out: Path, output: str, measures_meta: bool) -> tuple[dict, list[dict], list[str]]:
    """The output's JSON, its measured rows and its ratios' texts, once checked."""
    data = json.loads((out / f"{output}.json").read_text())
    measured = [row for row in data["rows"] if row["variant"] != "ratios"]
    assert measured and any("breakgraph" in row["variant"] for row in measured)
    assert (out / f"{output}.png").stat().st_size > 0
    ratios = [str(value) for row in data["rows"] if row["variant"] == "ratios" for value in row.values()]
    if measures_meta and META_INSTALLED:
        assert any(row["variant"] == META for row in measured), f"{output}: no {META!r} row"
        assert any("meta/" in value for value in ratios), f"{output}: no meta/ ratio"
    return data, measured, ratios


def test_decode_step_times_every_variant_warm_and_cold(tmp_path):
    pytest.importorskip("matplotlib")
    data, measured, ratios = check_outputs(quick_run("decode_step", tmp_path), "decode_step", True)
    for row in measured:
        assert row["step_ms"] > 0 and row["cold_step_ms"] > 0 and row["cold_over_warm"] > 0, row
    assert any("cold/warm step: breakgraph" in value for value in ratios)
    assert data["meta"]["eager_attention_sdpa_backend"] in SDPBackend.__members__


def test_transformers_generate_reports_cold_and_warm_generations(tmp_path):
    pytest.importorskip("matplotlib")
    pytest.importorskip("transformers", reason="the transformers extra is not installed")
    data, measured, ratios = check_outputs(quick_run("transformers_generate", tmp_path), "transformers_generate", False)
    for row in measured:
        assert row["cold_gen_s"] > 0 and row["cold_tok_s"] > 0 and row["warm_gen_s"] > 0 and row["warm_decode_tok_s"] > 0, row
        if row["variant"].startswith("breakgraph"):
            assert 0 < row["capture_s"] < row["cold_gen_s"], row  # the capture is part of the cold generation
        else:
            assert row["capture_s"] == "-"
        if "in background" in row["variant"]:
            assert row["compiled_s"] >= row["cold_gen_s"] and row["compiling_tok_s"] > 0, row  # served first, compiled later
        else:
            assert row["compiled_s"] == row["compiling_tok_s"] == "-"
    assert any("compile/breakable" in value for value in ratios) and any("full cold/warm" in value for value in ratios)
    batches = {row["batch"] for row in measured}
    ours = {row["variant"] for row in measured if row["variant"].startswith("breakgraph") and "sampling" not in row["variant"]}
    assert {"breakgraph breakable + compile", "breakgraph full + compile", "breakgraph breakable + compile in background"} <= ours
    targets = data["meta"]["targets"]
    assert len(targets) == (1 + len(ours)) * len(batches)  # per batch size: the best variant's decode, then one per variant
    assert sum("best breakgraph variant" in line for line in targets) == len(batches)
    assert all("torch.compile's" in line for line in targets)


def test_first_generation_measures_each_case_in_a_process_of_its_own(tmp_path):
    pytest.importorskip("transformers", reason="the transformers extra is not installed (pip install -e '.[transformers]')")
    pytest.importorskip("matplotlib")
    from benchmarks.first_generation import CASES

    data, measured, _ = check_outputs(quick_run("first_generation", tmp_path), "first_generation", False)
    assert [row["variant"] for row in measured] == [f"breakgraph breakable, {case}" for case in CASES.values()]
    for row in measured:
        assert 0 < row["warm_s"] and 0 < row["first_s"] <= row["until_first_s"]
        captured_before = row["variant"].endswith("after capture()")
        assert (row["capture_s"] == 0) == captured_before, row  # capture() took every size the call needs
        assert (row["before_s"] > 0) == (captured_before or row["variant"].endswith("after one eager step")), row
    assert len(data["meta"]["targets"]) == 1 and "nothing before" in data["meta"]["targets"][0]


def test_the_worked_example_times_capture_prefill_and_decode_on_the_gpu(tmp_path):
    pytest.importorskip("transformers", reason="the transformers extra is not installed")
    example = Path(__file__).resolve().parents[2] / "examples" / "llama_generate.py"
    done = subprocess.run(
        [sys.executable, str(example), "--batch", "2", "--prompt", "16", "--new", "8"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "no CUDA GPU" not in out
    for line in ("capture, batch sizes up to 2:", "prefill, 2 x 16 prompt tokens:", "decode, 2 x 7 tokens: the first time", "warm", "capture included"):
        assert line in out, out


def test_without_meta_s_library_a_benchmark_says_why_and_measures_the_rest(monkeypatch, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    monkeypatch.setitem(sys.modules, "breakable_cuda_graphs", None)  # importing it raises ImportError
    module = importlib.import_module("benchmarks.replay_overhead")
    assert module.main(["--quick", "--out", str(tmp_path)]) == 0
    assert MISSING in capsys.readouterr().out
    variants = {row["variant"] for row in json.loads((tmp_path / "replay_overhead.json").read_text())["rows"]}
    assert META not in variants and {"breakgraph replay", "torch CUDAGraph per segment"} <= variants


def test_training_timeline_sees_each_variants_launches_host_reads_and_gpu_work(tmp_path):
    pytest.importorskip("matplotlib")
    quick_run("training_timeline", tmp_path)
    data = json.loads((tmp_path / "training_timeline.json").read_text())
    rows = {row["variant"]: row for row in data["rows"]}
    assert (tmp_path / "training_timeline.png").stat().st_size > 0
    assert len(list(tmp_path.glob("training_timeline_*.json"))) == len(rows)  # a Chrome trace per variant
    assert rows["eager"]["graph launches"] == 0 and rows["eager"]["kernel launches"] > 10
    # Forward (its part before the first dropout launched with the rest), backward, optimizer step.
    assert rows["breakgraph"]["graph launches"] == rows["torch CUDAGraph per segment"]["graph launches"] == 3
    for name, row in rows.items():
        assert 0 < row["gpu_busy_us"] < row["step_us"], name
        reads = 0 if name.startswith("lower bound") else 2  # the loss, and the clip's finiteness check
        assert len(row["host_reads_at_us"]) == reads, name
    assert rows["breakgraph"]["allocations"] <= rows["eager"]["allocations"]
