"""The benchmarks and the worked example on a machine without a GPU: they say what they need
and exit with status 2 (argparse's status for a bad command line), never with torch's errors."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

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
    assert len(BENCHMARKS) == 8 and {"decode_step", "transformers_generate"} <= set(BENCHMARKS)


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
