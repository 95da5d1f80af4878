"""The benchmarks and the worked example without a GPU: they say what they need and exit with
status 2 (argparse's status for a bad command line), never with torch's errors; and the parts of
the cold measurements that need no GPU (which lengths are cold, the ratios, the plots)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.decoder import AttentionMetadata

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = sorted(path.stem for path in (ROOT / "benchmarks").glob("*.py") if "\ndef main(" in path.read_text())
EXAMPLE = ROOT / "examples" / "llama_generate.py"
NO_GPU = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}  # no GPU, even on a machine with one


@pytest.fixture(scope="module")
def benchmark_runs(tmp_path_factory):
    """Every benchmark's quickest run, started all at once (each spends its seconds importing torch)."""
    out = tmp_path_factory.mktemp("results")
    started = {
        name: subprocess.Popen(
            [sys.executable, "-m", f"benchmarks.{name}", "--quick", "--out", str(out)],
            cwd=ROOT, env=NO_GPU, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for name in BENCHMARKS
    }
    runs = {}
    for name, process in started.items():
        stdout, stderr = process.communicate(timeout=300)
        runs[name] = (process.returncode, stdout, stderr)
    return runs, out


def test_every_benchmark_is_found():
    known = {"capture_time", "decode_step", "graph_memory", "memory", "replay_overhead", "soak", "training_step", "transformers_generate"}
    assert known <= set(BENCHMARKS)  # and any new one is run by the test below


@pytest.mark.parametrize("name", BENCHMARKS)
def test_without_a_gpu_a_benchmark_says_it_needs_one_and_exits_2(name, benchmark_runs):
    runs, out = benchmark_runs
    returncode, stdout, stderr = runs[name]
    assert returncode == 2, stdout[-2000:] + stderr[-3000:]
    assert f"python3 -m benchmarks.{name} needs a CUDA GPU" in stderr and "nothing was measured" in stderr
    assert "Traceback" not in stderr
    assert not list(out.glob(f"{name}*")), "a benchmark without a GPU wrote results"


def example(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLE), *args], cwd=ROOT, env=NO_GPU, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--new", "0"], "argument --new: must be at least 2 (the prefill makes the first new token, decode steps the rest), got 0"),
        (["--new", "1"], "argument --new: must be at least 2"),
        (["--batch", "0"], "argument --batch: must be at least 1 (prompts generated side by side), got 0"),
        (["--prompt", "-3"], "argument --prompt: must be at least 1 (tokens in each prompt), got -3"),
        (["--batch", "two"], "argument --batch: must be a whole number, got 'two'"),
    ],
)
def test_the_example_refuses_bad_arguments_before_building_a_model(args, message):
    done = example(*args)
    assert done.returncode == 2
    assert message in done.stderr
    assert "cache slots" not in done.stderr and "Traceback" not in done.stderr
    assert done.stdout == ""  # refused before it said or built anything


def test_the_example_times_capture_prefill_and_decode_apart():
    done = example("--batch", "2", "--prompt", "6", "--new", "5")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout
    assert "no CUDA GPU" in lines and "row 0, first 16 new tokens" in lines
    assert "prefill, 2 x 6 prompt tokens:" in lines and "first" in lines and "warm" in lines
    assert "decode, 2 x 4 tokens:" in lines and "tokens/s" in lines


def fake_result(cold_s, warm_s, decode_tok_s, capture_s=None) -> dict:
    timings = {"cold_s": cold_s, "warm_s": warm_s, "capture_s": capture_s, "decode_tok_s": decode_tok_s, "ms_per_step": 3.0}
    return timings | {"memory_gib": 0.1, "tokens": [[1, 2, 3]], "compiled": True, "dynamo_graphs": 1}


def test_transformers_generate_says_which_cold_targets_are_met(tmp_path):
    pytest.importorskip("transformers", reason="the transformers extra is not installed")
    from benchmarks import transformers_generate as bench

    measured = {
        "eager": fake_result(9.0, 2.5, 50.0),
        "compile": fake_result(30.0, 0.5, 300.0),
        "breakable": fake_result(8.0, 0.4, 390.0, capture_s=0.5),  # 3.8x faster than compile, 20x its warm
        "full": fake_result(0.6, 0.45, 360.0, capture_s=0.4),  # 50x faster, 1.33x its warm
    }
    row, lines = bench.ratios(8, measured)
    assert row["cold_gen_s"] == "compile/breakable 3.8x; compile/full 50.0x"
    assert row["warm_gen_s"] == "breakable cold/warm 20.00x; full cold/warm 1.33x"
    assert row["warm_decode_tok_s"] == "breakable/compile 1.30x; full/compile 1.20x"
    assert lines == [
        "batch 8, best breakgraph variant breakgraph breakable: warm decode 1.30x torch.compile's tokens/s (met)",
        "batch 8, breakgraph breakable: cold generation 8.00 s, 3.8x faster than torch.compile's 30.00 s (NOT met); 20.00x its warm 0.400 s (NOT met)",
        "batch 8, breakgraph full: cold generation 0.60 s, 50.0x faster than torch.compile's 30.00 s (met); 1.33x its warm 0.450 s (met)",
    ]
    without_compile, _ = bench.ratios(8, {"full": measured["full"]})
    assert "cold_gen_s" not in without_compile and without_compile["warm_gen_s"] == "full cold/warm 1.33x"

    pytest.importorskip("matplotlib")
    rows = [bench.row_of(variant, 8, 128, result, measured["eager"]["tokens"]) for variant, result in measured.items()] + [row]
    assert rows[0]["capture_s"] == "-" and rows[2]["capture_s"] == 0.5 and rows[2]["cold_tok_s"] == 128.0
    bench.write_outputs("transformers_generate", rows, list(rows[0]), tmp_path, {}, lambda ax, measured_rows: bench.draw(ax, measured_rows, 128))
    assert (tmp_path / "transformers_generate.png").stat().st_size > 0


def test_transformers_generate_says_what_sampling_costs_against_greedy_per_mode():
    pytest.importorskip("transformers", reason="the transformers extra is not installed")
    from benchmarks import transformers_generate as bench

    measured = {
        "compile": fake_result(30.0, 0.5, 300.0),
        "breakable": fake_result(0.8, 0.4, 400.0, capture_s=0.5),
        "full": fake_result(0.6, 0.45, 360.0, capture_s=0.4),
        "breakable_sampling": fake_result(0.9, 0.41, 388.0, capture_s=0.5),  # 0.97x greedy's: met
        "full_sampling": fake_result(0.7, 0.5, 324.0, capture_s=0.4),  # 0.90x: not met
    }
    row, lines = bench.ratios(8, measured)
    assert row["warm_decode_tok_s"] == (
        "breakable/compile 1.33x; full/compile 1.20x; breakable sampling/greedy 0.97x; full sampling/greedy 0.90x"
    )
    assert len(lines) == 3  # the decode target's line, then the cold targets' one per greedy variant
    assert bench.sampling_costs(8, measured) == [
        "batch 8, breakgraph breakable: sampling decodes 388.0 tokens/s, 0.97x greedy's 400.0 (met)",
        "batch 8, breakgraph full: sampling decodes 324.0 tokens/s, 0.90x greedy's 360.0 (NOT met)",
    ]
    compiled = dict(measured, full_compile=fake_result(5.0, 0.3, 420.0, capture_s=4.0))  # 1.40x compile's, the best
    assert bench.ratios(8, compiled)[1][0] == "batch 8, best breakgraph variant breakgraph full + compile: warm decode 1.40x torch.compile's tokens/s (met)"
    alone, _ = bench.ratios(8, {"full": measured["full"], "full_sampling": measured["full_sampling"]})
    assert alone["warm_decode_tok_s"] == "full sampling/greedy 0.90x"
    assert bench.sampling_costs(8, {"full_sampling": measured["full_sampling"]}) == []
    sampled = bench.row_of("full_sampling", 8, 128, measured["full_sampling"], None)
    assert sampled["variant"] == "breakgraph full, sampling" and sampled["same_as_eager"] == "-"


def test_decode_step_times_every_variant_cold_at_lengths_no_step_had(monkeypatch):
    from benchmarks import decode_step

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    step = decode_step.Step.__new__(decode_step.Step)  # the timing alone, without the GPU's captures
    step.meta, step.positions = AttentionMetadata(1008), torch.zeros(2, dtype=torch.long)
    lengths = {"eager": [], "breakgraph": []}
    step.runs = lambda: {name: (lambda seen=seen: seen.append((step.meta.length, int(step.positions[1])))) for name, seen in lengths.items()}
    unseen = iter(range(decode_step.LIVE_LENGTHS[0] - 1, 0, -1))
    cold = step.cold_us(unseen)
    assert set(cold) == set(lengths) and all(us > 0 for us in cold.values())
    steps = decode_step.COLD_STEPS
    assert lengths["eager"] == [(n, n) for n in range(1007, 1007 - steps, -1)]  # the device's copy follows
    assert lengths["breakgraph"] == [(n, n) for n in range(1007 - steps, 1007 - 2 * steps, -1)]
    assert next(unseen) == 1007 - 2 * steps  # the next batch size starts below


def test_decode_step_plots_the_cold_step_on_each_bar(monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks import decode_step
    from benchmarks.common import write_outputs

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "no GPU")
    rows = [
        {"batch": batch, "variant": variant, "step_ms": warm * batch, "cold_step_ms": cold * batch}
        for batch in (1, 8)
        for variant, warm, cold in (("eager", 5.0, 65.0), ("breakgraph", 2.0, 62.0), ("full", 1.5, 1.5))
    ]
    drawn = {}

    def draw(ax, measured):
        decode_step.draw(ax, measured)
        drawn["bars"] = [(patch.get_x() + patch.get_width() / 2, patch.get_height()) for patch in ax.patches]
        drawn["marks"] = [tuple(point) for point in ax.collections[0].get_offsets()]

    write_outputs("decode_step", rows, ["batch", "variant", "step_ms", "cold_step_ms"], tmp_path, {}, draw)
    pairs = {(height, cold) for (x, height), (x_mark, cold) in zip(drawn["bars"], drawn["marks"]) if x == x_mark}
    assert pairs == {(row["step_ms"], row["cold_step_ms"]) for row in rows}  # each mark on its own bar
    assert (tmp_path / "decode_step.png").stat().st_size > 0


def test_alternated_timing_calls_each_variant_once_a_round_in_a_shuffled_order(monkeypatch):
    from benchmarks import common

    now, calls = [0], []

    def variant(name, ns):
        def call():
            calls.append(name)
            now[0] += ns

        return call

    monkeypatch.setattr(common.time, "perf_counter_ns", lambda: now[0])
    durations = {"a": 1000, "b": 2000, "c": 3000}
    medians = common.time_alternated({name: variant(name, ns) for name, ns in durations.items()}, rounds=6)
    assert medians == {"a": 1.0, "b": 2.0, "c": 3.0}  # µs, each call timed on its own
    rounds = [tuple(calls[i : i + 3]) for i in range(0, len(calls), 3)]
    assert len(rounds) == 6 and all(sorted(names) == ["a", "b", "c"] for names in rounds)
    assert len(set(rounds)) > 1  # shuffled
