"""The benchmarks and the worked example without a GPU: they say what they need and exit with
status 2 (argparse's status for a bad command line), never with torch's errors; their command
lines (the usage line, --out checked before measuring, a misspelt option's likely meaning); the parts of
the cold measurements that need no GPU (which lengths are cold, the ratios, the plots); and the
tensor-parallel benchmark's sharded decoder, checked against the whole one on CPU threads standing
for ranks, its ratios and its outputs."""

import importlib
import os
import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from benchmarks.decoder import AttentionMetadata, Decoder, DecoderConfig, TensorParallel

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
    known = {
        "capture_time", "conditional", "decode_step", "first_generation", "graph_memory", "memory", "replay_overhead", "soak", "tensor_parallel",
        "training_step", "transformers_generate",
    }
    assert known <= set(BENCHMARKS)  # and any new one is run by the test below


@pytest.mark.parametrize("name", BENCHMARKS)
def test_without_a_gpu_a_benchmark_says_it_needs_one_and_exits_2(name, benchmark_runs):
    runs, out = benchmark_runs
    returncode, stdout, stderr = runs[name]
    assert returncode == 2, stdout[-2000:] + stderr[-3000:]
    assert f"python3 -m benchmarks.{name} needs a CUDA GPU" in stderr and "nothing was measured" in stderr
    assert "Traceback" not in stderr
    assert not list(out.glob(f"{name}*")), "a benchmark without a GPU wrote results"


class Measuring(Exception):
    """Raised where a benchmark would begin: nothing is measured."""


def benchmark_main(name: str, monkeypatch):
    """``name``'s main, stopped with Measuring once its command line is read."""
    if name == "transformers_generate":
        pytest.importorskip("transformers", reason="the transformers extra is not installed")
    module = importlib.import_module(f"benchmarks.{name}")

    def measuring(benchmark):
        raise Measuring(benchmark)

    monkeypatch.setattr(module, "require_gpu", measuring)
    return module.main


@pytest.mark.parametrize("name", BENCHMARKS)
def test_a_benchmarks_usage_line_is_the_command_that_runs_it(name, monkeypatch, capsys):
    with pytest.raises(SystemExit) as leaving:
        benchmark_main(name, monkeypatch)(["--help"])
    usage = capsys.readouterr().out.splitlines()[0]
    assert leaving.value.code == 0
    if name == "tensor_parallel":  # the command its docstring gives: torchrun starts the ranks
        assert usage == "usage: torchrun --nproc-per-node T -m benchmarks.tensor_parallel"
    else:
        assert usage.startswith(f"usage: python3 -m benchmarks.{name} [-h] [--out FOLDER]")  # not the file, which cannot import benchmarks


@pytest.mark.parametrize("name", BENCHMARKS)
def test_a_benchmark_refuses_an_out_folder_it_cannot_make_before_measuring(name, monkeypatch, tmp_path, capsys):
    main, blocker = benchmark_main(name, monkeypatch), tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as leaving:
        main(["--quick", "--out", str(blocker / "results")])
    assert leaving.value.code == 2
    assert (
        f"error: argument --out: {blocker / 'results'} cannot be made: {blocker} is a file; give --out a folder you can write "
        "(it is made if missing)"
    ) in capsys.readouterr().err


@pytest.mark.parametrize("name", BENCHMARKS)
def test_a_benchmark_takes_an_out_folder_it_can_make_without_making_it_before_measuring(name, monkeypatch, tmp_path):
    with pytest.raises(Measuring):
        benchmark_main(name, monkeypatch)(["--quick", "--out", str(tmp_path / "new" / "results")])
    assert not (tmp_path / "new").exists()  # made only when there are results to write


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc, where no file can be made")
def test_a_benchmark_says_why_an_out_folder_cannot_be_made(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        benchmark_main("replay_overhead", monkeypatch)(["--out", "/proc/nonexistent"])
    assert capsys.readouterr().err.endswith(
        "python3 -m benchmarks.replay_overhead: error: argument --out: /proc/nonexistent does not exist and cannot be made in /proc "
        "(No such file or directory); give --out a folder you can write (it is made if missing)\n"
    )


@pytest.mark.parametrize("name", BENCHMARKS)
def test_a_benchmark_names_the_option_a_misspelt_one_meant(name, monkeypatch, capsys):
    with pytest.raises(SystemExit) as leaving:
        benchmark_main(name, monkeypatch)(["--quik"])
    assert leaving.value.code == 2
    assert "error: unrecognized arguments: --quik; did you mean --quick?" in capsys.readouterr().err


def test_a_child_process_hands_back_the_json_it_wrote_or_its_output_where_it_fails_hangs_or_writes_nothing(tmp_path):
    from benchmarks.common import run_child

    (tmp_path / "child_writes.py").write_text(
        "import json, sys\nargs = sys.argv[1:]\njson.dump({'args': args}, open(args[args.index('--result') + 1], 'w'))\n"
    )
    (tmp_path / "child_fails.py").write_text("import sys\nprint('it went wrong', file=sys.stderr)\nsys.exit(3)\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    measured = run_child("child_writes", ["--one", "x"], env, timeout=60, what="the child")
    assert measured["args"][:3] == ["--one", "x", "--result"]
    with pytest.raises(RuntimeError, match=r"the child failed:\n(.|\n)*it went wrong"):
        run_child("child_fails", [], env, timeout=60, what="the child")
    (tmp_path / "child_forgets.py").write_text("print('measured, but not written')\n")
    with pytest.raises(RuntimeError, match=r"the child wrote no result:\nmeasured, but not written"):
        run_child("child_forgets", [], env, timeout=60, what="the child")
    (tmp_path / "child_hangs.py").write_text("import time\nprint('started', flush=True)\ntime.sleep(60)\n")
    with pytest.raises(RuntimeError, match=r"the child ran past 2 s:\nstarted"):
        run_child("child_hangs", [], env, timeout=2, what="the child")


def test_transformers_generates_children_check_the_parents_out_folder(monkeypatch, tmp_path):
    pytest.importorskip("transformers", reason="the transformers extra is not installed")
    from benchmarks import common, transformers_generate_runs as runs
    from benchmarks.common import benchmark_parser

    commands = []
    monkeypatch.setattr(common.subprocess, "run", lambda command, **_: commands.append(command) or subprocess.CompletedProcess(command, 1, "", ""))
    args = benchmark_parser("transformers_generate", "").parse_args(["--out", str(tmp_path)])
    args.prompt, args.new, args.dtype, args.repeats, args.quick = 16, 16, "float32", 1, True
    with pytest.raises(RuntimeError):
        runs.run_fresh("eager", 1, args)
    assert commands[0][commands[0].index("--out") + 1] == str(tmp_path)


def test_first_generations_children_get_the_parents_settings_and_only_one_case_loads_kernels_eagerly(monkeypatch, tmp_path):
    from benchmarks import common, first_generation as bench

    calls = []
    monkeypatch.setenv("CUDA_MODULE_LOADING", "LAZY")  # the parent's own setting reaches no case
    monkeypatch.setattr(common.subprocess, "run", lambda command, env, **_: calls.append((command, env)) or subprocess.CompletedProcess(command, 1, "", ""))
    args = bench.parse(["--out", str(tmp_path), "--prompt", "16", "--new", "8", "--repeats", "2", "--quick"])
    for case in bench.CASES:
        with pytest.raises(RuntimeError, match=re.escape(f"full, {bench.CASES[case]}, batch 4 failed")):
            bench.run_fresh(case, "full", 4, args)
    for (command, env), case in zip(calls, bench.CASES):
        child = bench.parse(command[command.index("--one") :])
        assert (child.one, child.modes, child.batches, child.prompt, child.new, child.repeats, child.quick) == (case, ["full"], [4], 16, 8, 2, True)
        assert child.out == str(tmp_path) and child.result
        assert env.get("CUDA_MODULE_LOADING") == ("EAGER" if case == "eager_loading" else None)


def test_first_generation_says_whether_a_first_call_with_nothing_before_meets_the_target():
    from benchmarks.first_generation import target_line

    assert target_line("breakable", 8, {"nothing": {"first_over_warm": 1.93}, "capture": {"first_over_warm": 1.2}}) == (
        "breakable, batch 8: first over warm 1.93x, nothing before (NOT met); after capture() 1.20x"
    )
    assert target_line("full", 1, {"nothing": {"first_over_warm": 1.4}}) == "full, batch 1: first over warm 1.40x, nothing before (met)"
    assert target_line("full", 1, {"eager_step": {"first_over_warm": 1.3}}) == (
        "full, batch 1: first over warm with nothing before not measured (--cases); after one eager step 1.30x"
    )


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
    from benchmarks import decode_step_variants as decode_step

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



# -- tensor parallelism -------------------------------------------------------------------

SMALL = DecoderConfig(layers=2, hidden=64, heads=8, kv_heads=4, intermediate=96, kv_capacity=32, dtype=torch.float32)


def test_a_decoder_on_one_rank_is_the_decoder_it_was_weight_for_weight():
    decoder = Decoder(SMALL, max_batch=3, device="cpu", seed=5)
    generator = torch.Generator().manual_seed(5)  # the draws in the order the decoder made them before it could be sharded

    def weight(*shape):
        return (torch.randn(*shape, generator=generator) * 0.02).to(SMALL.dtype)

    hidden, kv = SMALL.hidden, SMALL.kv_heads * SMALL.head_dim
    for layer in decoder.layers:
        expected = {"qkv": weight(hidden, hidden + 2 * kv), "out": weight(hidden, hidden), "gate_up": weight(hidden, 192), "down": weight(96, hidden)}
        assert all(torch.equal(layer[name], tensor) for name, tensor in expected.items())
    cache = (3, SMALL.kv_capacity, SMALL.kv_heads, SMALL.head_dim)
    assert all(torch.equal(k, torch.randn(cache, generator=generator)) for k in decoder.k_cache)
    assert all(torch.equal(v, torch.randn(cache, generator=generator)) for v in decoder.v_cache)


def test_a_shard_holds_its_share_of_every_head_and_column_and_refuses_a_world_that_does_not_divide_them():
    shard = Decoder(SMALL, max_batch=3, device="cpu", tp=TensorParallel(rank=3, world=4))
    d = SMALL.head_dim
    assert (shard.heads, shard.kv_heads, shard.intermediate) == (2, 1, 24)
    assert shard.layers[0]["qkv"].shape == (64, 2 * d + 2 * d) and shard.layers[0]["out"].shape == (2 * d, 64)
    assert shard.layers[0]["gate_up"].shape == (64, 48) and shard.layers[0]["down"].shape == (24, 64)
    assert shard.k_cache[0].shape == (3, 32, 1, d)
    other = Decoder(SMALL, max_batch=3, device="cpu", tp=TensorParallel(rank=2, world=4))
    assert not torch.equal(shard.layers[0]["qkv"], other.layers[0]["qkv"])  # a seed of each rank's own
    with pytest.raises(ValueError, match="8 attention heads do not split among 3 tensor-parallel ranks"):
        Decoder(SMALL, max_batch=3, device="cpu", tp=TensorParallel(rank=0, world=3))
    with pytest.raises(ValueError, match="4 key/value heads do not split among 8"):
        Decoder(SMALL, max_batch=3, device="cpu", tp=TensorParallel(rank=0, world=8))


class FakeRanks:
    """``torch.distributed.all_reduce`` among threads, one per rank (``group`` is the thread's rank)."""

    def __init__(self, world: int):
        self.barrier = threading.Barrier(world, timeout=60)
        self.parts = [None] * world

    def all_reduce(self, tensor, group=None):
        self.parts[group] = tensor.clone()
        self.barrier.wait()
        total = sum(self.parts)  # in rank order on every rank
        self.barrier.wait()
        tensor.copy_(total)


@pytest.mark.parametrize("world", [2, 4])
def test_the_shards_steps_summed_are_the_step_of_the_decoder_they_make_up(world, monkeypatch):
    ranks = FakeRanks(world)
    monkeypatch.setattr(torch.distributed, "all_reduce", ranks.all_reduce)
    shards = [Decoder(SMALL, max_batch=3, device="cpu", tp=TensorParallel(rank, world, group=rank)) for rank in range(world)]
    whole = Decoder(SMALL, max_batch=3, device="cpu")  # its weights replaced by the shards', put together
    q, kv = shards[0].heads * SMALL.head_dim, shards[0].kv_heads * SMALL.head_dim
    for index, layer in enumerate(whole.layers):
        parts = [shard.layers[index] for shard in shards]
        qkv = [part["qkv"].split([q, kv, kv], dim=1) for part in parts]
        layer["qkv"] = torch.cat([piece[which] for which in range(3) for piece in qkv], dim=1)
        gate_up = [part["gate_up"].chunk(2, dim=1) for part in parts]
        layer["gate_up"] = torch.cat([piece[which] for which in range(2) for piece in gate_up], dim=1)
        layer["out"] = torch.cat([part["out"] for part in parts])
        layer["down"] = torch.cat([part["down"] for part in parts])
        whole.k_cache[index] = torch.cat([shard.k_cache[index] for shard in shards], dim=2)
        whole.v_cache[index] = torch.cat([shard.v_cache[index] for shard in shards], dim=2)
    x = torch.randn(3, SMALL.hidden)
    positions = torch.tensor([20, 20, 20])
    with ThreadPoolExecutor(world) as pool:
        sharded = list(pool.map(lambda shard: shard.step(x.clone(), positions, AttentionMetadata(20)), shards))
    expected = whole.step(x.clone(), positions, AttentionMetadata(20))
    for rank, got in enumerate(sharded):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4, msg=lambda m: f"rank {rank}: {m}")
    assert all(torch.equal(got, sharded[0]) for got in sharded)  # every rank ends with the same rows


def test_tensor_parallel_ratios_say_which_targets_are_met():
    from benchmarks import tensor_parallel_capture as capture
    from benchmarks import tensor_parallel_decode as decode

    us = {
        decode.EAGER: 12000.0, decode.TORCH: 2200.0, decode.BREAKABLE: 2000.0, decode.AGREED: 2100.0, decode.BARE: 1980.0,
        decode.BOUND: 1850.0, decode.FULL: 1700.0, decode.FULL_BARE: 1690.0, decode.FULL_BOUND: 1650.0,
    }
    row, lines = decode.decode_ratios(8, us, world=2)
    assert row["variant"] == "ratios" and row["notes"].startswith("breakable/bound 1.08x; full/same-work monolithic 1.030x; torch per segment/breakable 1.10x")
    assert lines == [
        "batch 8: breakgraph breakable 1.08x its frozen-length bound (target <= 1.10x: met; torch's per-segment graphs: 1.19x)",
        "batch 8: breakgraph full 1.030x the same work as one monolithic graph (target <= 1.02x: NOT met)",
        "batch 8: torch CUDAGraph per segment 1.10x breakgraph breakable's step (target >= 1.00x: met)",
    ]
    slow_meta = dict(us, **{decode.META: 1990.0})
    assert decode.decode_ratios(8, slow_meta, world=4)[1][-1] == (
        "batch 8: Meta breakable_cuda_graphs 0.99x breakgraph breakable's step (target >= 1.00x: NOT met)"
    )
    assert "the target is set for T = 2 and 4, this is T = 1" in decode.decode_ratios(1, us, world=1)[1][0]

    runs = {capture.WITH_GROUP: [(5.0, 300.0), (6.0, 310.0), (5.0, 305.0)], capture.WITHOUT_GROUP: [(0.0, 300.0), (0.0, 290.0), (0.0, 295.0)]}
    row, line = capture.capture_ratio(runs, [1, 2, 4, 8, 16, 24, 32])
    assert row["batch"] == "7 sizes, 1-32" and row["notes"] == "with/without group 1.051x made and captured, 1.034x capture() alone"
    assert line == "7 sizes: agreement (group=) adds +5.1 % to making and capturing a runner (NOT met) and +3.4 % to its capture() alone (met); target <= 5 %"


def test_tensor_parallel_generation_compares_the_best_breakgraph_variant_with_torch_compile():
    from benchmarks import tensor_parallel_hf as bench

    result = lambda tok_s: {"decode_tok_s": tok_s, "ms_per_step": 1000 / tok_s, "tokens": [[1, 2]]}  # noqa: E731
    measured = {"eager": result(50.0), "compile": result(300.0), "breakable": result(380.0), "full": result(330.0), "breakable_compile": result(420.0)}
    row, lines = bench.generate_ratios(1, measured, {}, compiled=True, world=2)
    assert row["notes"] == "breakable/compile 1.27x; full/compile 1.10x; breakable_compile/compile 1.40x"
    assert lines == ["batch 1: best breakgraph variant breakgraph breakable + compile: 1.40x torch.compile's decode tokens/s (target >= 1.3x: met)"]
    without = {name: value for name, value in measured.items() if name != "compile"}
    row, lines = bench.generate_ratios(8, without, {"compile": "RecompileError: guard failed"}, compiled=True, world=4)
    assert lines == ["batch 8: transformers static + torch.compile failed at T = 4 (RecompileError: guard failed): no ratio"]
    assert bench.generate_ratios(1, measured, {}, compiled=False, world=2)[1][0].endswith("so its figure is uncompiled")


def test_tensor_parallel_sizes_the_checkpoint_it_writes():
    from benchmarks.tensor_parallel_hf import checkpoint_bytes
    from breakgraph.hf.shapes import LLAMA_3_2_1B

    assert checkpoint_bytes(LLAMA_3_2_1B) == 2 * 1_235_814_400  # Llama-3.2-1B's parameters, in bf16
    assert checkpoint_bytes(dict(LLAMA_3_2_1B, tie_word_embeddings=False)) == 2 * (1_235_814_400 + 128256 * 2048)


def test_tensor_parallel_takes_its_settings_and_writes_one_table_and_plot(monkeypatch, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from benchmarks import tensor_parallel as bench
    from benchmarks.tensor_parallel_capture import WITH_GROUP
    from benchmarks.tensor_parallel_decode import BOUND, BREAKABLE, EAGER

    quick, full = bench.parse(["--quick"]), bench.parse(["--parts", "hf", "capture"])
    assert (quick.batches, quick.new, quick.prompt, quick.parts) == ([1, 8], 16, 16, ["decoder", "capture", "hf"])
    assert (full.batches, full.new, full.prompt, full.parts) == ([1, 8, 32], 64, 128, ["hf", "capture"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "no GPU")
    rows = [
        {"part": bench.DECODE, "batch": batch, "variant": variant, "ms": ms * batch, "tokens_per_s": 1.0, "max_abs_diff_vs_eager": 0.01}
        for batch in (1, 8) for variant, ms in ((EAGER, 10.0), (BREAKABLE, 2.0), (BOUND, 1.9))
    ]
    rows += [{"part": bench.DECODE, "batch": 8, "variant": "ratios", "notes": "breakable/bound 1.05x"}]
    rows += [{"part": bench.CAPTURE, "batch": "7 sizes, 1-32", "variant": WITH_GROUP, "ms": 300.0, "notes": "made 5.0 ms"}]
    rows += [{"part": bench.GENERATE, "batch": 1, "variant": "transformers static + torch.compile", "ms": "failed", "notes": "ValueError: no"}]
    drawn = {}

    def draw(ax, measured):
        bench.draw(ax, measured, 2)
        drawn["bars"] = len(ax.patches)
        drawn["title"] = ax.get_title()

    bench.write_outputs("tensor_parallel_tp2", rows, bench.COLUMNS, tmp_path, {}, draw)
    assert capsys.readouterr().out.splitlines()[0].split() == bench.COLUMNS
    assert drawn == {"bars": 6, "title": "Decode step, tensor parallel 2 (no GPU)"}  # the decode step's 3 variants at 2 batches
    assert (tmp_path / "tensor_parallel_tp2.json").stat().st_size > 0 and (tmp_path / "tensor_parallel_tp2.png").stat().st_size > 0
    capture_only = [row for row in rows if row["part"] == bench.CAPTURE]
    bench.write_outputs("capture_only", capture_only, bench.COLUMNS, tmp_path, {}, draw)
    assert drawn == {"bars": 1, "title": "Capture, tensor parallel 2 (no GPU)"}
