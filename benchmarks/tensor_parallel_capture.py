"""The capture part of ``tensor_parallel``: a runner's start-up with ``group=`` and without.

With ``group=``, the ranks agree once, as the capture ends, on the captures to
keep (each is kept on every rank or on none). This part measures what that
adds to making and capturing a runner, the two ways in turns so that drift
falls on both.
"""

from __future__ import annotations

import functools
import gc
import statistics
import time

import torch
import torch.distributed as dist

import breakgraph as bg
from benchmarks.attention import attention_break
from benchmarks.common import verdict
from benchmarks.decode_step_variants import FROZEN_LENGTH
from benchmarks.decoder import Decoder, DecoderConfig, TensorParallel
from benchmarks.decoder_sizes import BatchInputs, check_sizes, runner_replay
from benchmarks.tensor_parallel_ranks import checked_on_every_rank

CAPTURE = "capture"  # the part, as the table's "part" column names it
WITH_GROUP = "GraphRunner(..., group=WORLD)"
WITHOUT_GROUP = "GraphRunner without group"
AGREEMENT_TARGET = 1.05  # a runner's start-up with group over without, at most


def slowest_rank(*seconds: float) -> list[float]:
    """Each of ``seconds``, the largest of any rank's."""
    values = torch.tensor(seconds, dtype=torch.float64, device="cuda")
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values.tolist()


def start_up(inputs: BatchInputs, sizes, options: dict) -> tuple[bg.GraphRunner, float, float]:
    """A runner made and captured at ``sizes``; the slowest rank's seconds making it and capturing."""
    dist.barrier()
    torch.cuda.synchronize()
    started = time.perf_counter()
    runner = bg.GraphRunner(inputs.step_fn(attention_break), (inputs.x, inputs.positions), sizes, progress=False, **options)
    made = time.perf_counter()
    runner.capture()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return runner, *slowest_rank(made - started, done - made)


def capture_ratio(runs: dict, sizes) -> tuple[dict, str]:
    """The ratios row and target line of the runs {way: [(make ms, capture ms), ...]}."""
    total = {way: statistics.median(make + capture for make, capture in samples) for way, samples in runs.items()}
    alone = {way: statistics.median(capture for _make, capture in samples) for way, samples in runs.items()}
    ratio, capture_only = total[WITH_GROUP] / total[WITHOUT_GROUP], alone[WITH_GROUP] / alone[WITHOUT_GROUP]
    row = {"part": CAPTURE, "batch": sizes_label(sizes), "variant": "ratios",
           "notes": f"with/without group {ratio:.3f}x made and captured, {capture_only:.3f}x capture() alone"}
    line = (
        f"{len(sizes)} sizes: agreement (group=) adds {(ratio - 1) * 100:+.1f} % to making and capturing a runner "
        f"({verdict(ratio, AGREEMENT_TARGET, at_most=True)}) and {(capture_only - 1) * 100:+.1f} % to its capture() alone "
        f"({verdict(capture_only, AGREEMENT_TARGET, at_most=True)}); target <= {(AGREEMENT_TARGET - 1) * 100:.0f} %"
    )
    return row, line


def sizes_label(sizes) -> str:
    return f"{len(sizes)} sizes, {sizes[0]}-{sizes[-1]}"


def check_each_size(inputs: BatchInputs, runner: bg.GraphRunner, sizes) -> float:
    """``check_sizes`` of the runner, every size checked before a difference is raised (the ranks'
    collectives stay paired); the largest difference."""
    worst, failures = 0.0, []
    for size in sizes:
        try:
            worst = max(worst, check_sizes(inputs, runner_replay(inputs, runner), [size]))
        except AssertionError as failure:
            failures.append(str(failure))
    if failures:
        raise AssertionError("; ".join(failures))
    return worst


def capture_part(config: DecoderConfig, args, tp: TensorParallel) -> tuple[list, list, dict]:
    sizes = bg.default_capture_sizes(32)
    decoder = Decoder(config, max_batch=max(sizes), tp=tp)
    inputs = BatchInputs(decoder, max(sizes), length=FROZEN_LENGTH)
    inputs.warm_up(sizes, torch.cuda.Stream())
    checked = sorted({sizes[0], sizes[len(sizes) // 2], sizes[-1]})
    ways = {WITH_GROUP: {"group": tp.group}, WITHOUT_GROUP: {}}
    runs = {way: [] for way in ways}
    worst = dict.fromkeys(ways, 0.0)
    for turn in range(args.turns + 1):  # in turns, so that drift falls on both; the first turn's first uses untimed
        for way, options in ways.items():
            runner, make_s, capture_s = start_up(inputs, sizes, options)
            if turn:
                runs[way].append((make_s * 1000, capture_s * 1000))
            worst[way] = max(worst[way], checked_on_every_rank(functools.partial(check_each_size, inputs, runner, checked), tp))
            del runner
            gc.collect()
    rows = []
    for way, samples in runs.items():
        make, capture = statistics.median(m for m, _c in samples), statistics.median(c for _m, c in samples)
        rows.append({
            "part": CAPTURE, "batch": sizes_label(sizes), "variant": way,
            "ms": round(statistics.median(m + c for m, c in samples), 1), "max_abs_diff_vs_eager": round(worst[way], 4),
            "notes": f"made {make:.1f} ms, capture() {capture:.1f} ms (medians of {len(samples)})",
        })
    row, line = capture_ratio(runs, sizes)
    about = {"sizes": sizes, "runs_ms_made_and_captured": {way: [[round(m, 2), round(c, 2)] for m, c in samples] for way, samples in runs.items()}}
    return rows + [row], [line], about
