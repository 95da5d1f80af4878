"""A Generator's first ``generate()`` in a fresh process against its warm one, and what running
something before it buys.

A Llama-3.2-1B-shaped model (random weights from a config: nothing is downloaded) in bfloat16
generates ``--new`` tokens after a ``--prompt``-token prompt. Each case runs in a process of its
own, the Generator made and called as a server starting up would make and call it:

- ``nothing before``: the first call right after the Generator is made; it captures the decode
  step at its batch size (an eager warm-up step, then the capture) before its prefill;
- ``after capture()``: ``generator.capture()`` first, every capture size (1, 2, 4, 8);
- ``after one eager step``: one eager forward of the model over one token a row first
  (transformers' own attention and cache), which launches most of a decode step's kernels at
  its row count;
- ``kernels loaded at once``: nothing before, with ``CUDA_MODULE_LOADING=EAGER``, so CUDA loads a
  library's kernels all at once where it would load each at its first launch.

Reported per case: the Generator's construction, what ran before the first call, the first call
and the capture inside it, a warm call (the median of ``--repeats``), first over warm, and the
wait from construction to the first call's end. The first call's tokens must equal the warm
call's (greedy decoding of the same prompts).

    python3 -m benchmarks.first_generation [--quick] [--out results] [--modes breakable full] [--batches 1 8]
                                           [--cases nothing capture eager_step eager_loading]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from benchmarks.common import benchmark_parser, device_meta, plot_grouped_bars, require_gpu, run_child, verdict, write_outputs
from benchmarks.hf_generation import build_model, capture_seconds, prompts, timed

CASES = {
    "nothing": "nothing before",
    "capture": "after capture()",
    "eager_step": "after one eager step",
    "eager_loading": "kernels loaded at once",
}
MAX_BATCH = 8  # the Generator's capture sizes: 1, 2, 4, 8
TARGET = 1.5  # first over warm, nothing before
COLUMNS = ["variant", "batch", "made_s", "before_s", "first_s", "capture_s", "warm_s", "first_over_warm", "until_first_s"]


def measure_one(case: str, mode: str, batch: int, shape: dict, prompt: int, new: int, repeats: int) -> dict:
    """One case in this (fresh) process: make the Generator, run what the case runs first, then
    the first call and warm ones."""
    from breakgraph import hf

    model = build_model(shape, torch.bfloat16)
    model.set_attn_implementation(hf.ATTENTION)
    ids = prompts(batch, prompt, model.config.vocab_size, seed=batch)
    made_s, generator = timed(lambda: hf.Generator(model, max_length=prompt + new, max_batch_size=MAX_BATCH, mode=mode, progress=False))
    before_s = 0.0
    if case == "capture":
        before_s = timed(generator.capture)[0]
    elif case == "eager_step":
        with torch.no_grad():
            before_s = timed(lambda: model(ids[:, :1]))[0]
    captured_before = capture_seconds(generator.runner)
    first_s, first = timed(lambda: generator.generate(ids, new))
    capture_s = capture_seconds(generator.runner) - captured_before
    warm = []
    for _ in range(repeats):
        seconds, again = timed(lambda: generator.generate(ids, new))
        if not torch.equal(first, again):
            raise RuntimeError(f"{mode}, {CASES[case]}, batch {batch}: a warm call's tokens differ from the first call's")
        warm.append(seconds)
    warm_s = statistics.median(warm)
    return {
        "made_s": made_s, "before_s": before_s, "first_s": first_s, "capture_s": capture_s, "warm_s": warm_s,
        "first_over_warm": first_s / warm_s, "until_first_s": made_s + before_s + first_s,
    }


def run_fresh(case: str, mode: str, batch: int, args) -> dict:
    """``measure_one`` in a fresh process, as a server starts."""
    env = {name: value for name, value in os.environ.items() if name != "CUDA_MODULE_LOADING"}  # torch's default: lazy
    if case == "eager_loading":
        env["CUDA_MODULE_LOADING"] = "EAGER"
    arguments = ["--one", case, "--modes", mode, "--batches", str(batch), "--prompt", str(args.prompt), "--new", str(args.new)]
    arguments += ["--repeats", str(args.repeats), "--out", args.out] + (["--quick"] if args.quick else [])
    return run_child("benchmarks.first_generation", arguments, env, timeout=600, what=f"{mode}, {CASES[case]}, batch {batch}")


def target_line(mode: str, batch: int, measured: dict) -> str:
    """What the target asks of a first call with nothing before, and where the cases put it."""
    line = f"{mode}, batch {batch}: first over warm "
    if "nothing" in measured:
        ratio = measured["nothing"]["first_over_warm"]
        line += f"{ratio:.2f}x, nothing before ({verdict(ratio, TARGET, at_most=True)})"
    else:
        line += "with nothing before not measured (--cases)"
    others = [f"{CASES[case]} {result['first_over_warm']:.2f}x" for case, result in measured.items() if case != "nothing"]
    return line + ("; " + ", ".join(others) if others else "")


def parse(argv) -> argparse.Namespace:
    parser = benchmark_parser("first_generation", __doc__)
    parser.add_argument("--quick", action="store_true", help="small smoke run: a 2-layer model, breakable, batch 1, 16-token prompts, 16 new tokens")
    parser.add_argument("--modes", nargs="+", default=None, choices=["breakable", "full"], help="(breakable full)")
    parser.add_argument("--batches", type=int, nargs="+", default=None, choices=range(1, MAX_BATCH + 1), metavar="N", help="batch sizes, 1 to 8 (1 8)")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES), help="what runs before the first call (all)")
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (128)")
    parser.add_argument("--new", type=int, default=None, help="new tokens (128)")
    parser.add_argument("--repeats", type=int, default=5, help="warm calls timed, the median kept (5)")
    parser.add_argument("--one", choices=list(CASES), help=argparse.SUPPRESS)  # a child process: one measurement
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for option, least in (("prompt", 1), ("new", 2), ("repeats", 1)):  # new: the prefill makes one token, decode steps the rest
        value = getattr(args, option)
        if value is not None and value < least:
            parser.error(f"argument --{option}: must be at least {least}, got {value}")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    require_gpu("first_generation")
    from benchmarks.transformers_generate import QUICK
    from breakgraph import hf

    args.prompt = args.prompt or (16 if args.quick else 128)
    args.new = args.new or (16 if args.quick else 128)
    args.batches = args.batches or ([1] if args.quick else [1, 8])
    args.modes = args.modes or (["breakable"] if args.quick else ["breakable", "full"])
    shape = QUICK if args.quick else hf.LLAMA_3_2_1B
    if args.one:  # the child of run_fresh: its measurement, written where the parent reads it
        measured = measure_one(args.one, args.modes[0], args.batches[0], shape, args.prompt, args.new, args.repeats)
        with open(args.result, "w") as out:
            json.dump(measured, out)
        return 0
    started = time.perf_counter()
    rows, targets = [], []
    for mode in args.modes:
        for batch in args.batches:
            measured = {case: run_fresh(case, mode, batch, args) for case in args.cases}
            for case, result in measured.items():
                rows.append({"variant": f"breakgraph {mode}, {CASES[case]}", "batch": batch, **{k: round(v, 3) for k, v in result.items()}})
                print(rows[-1], flush=True)
            targets.append(target_line(mode, batch, measured))
    import transformers

    meta = device_meta() | {"transformers": transformers.__version__, "prompt": args.prompt, "new": args.new, "targets": targets}
    meta["model"] = "tiny Llama" if args.quick else "Llama-3.2-1B shape"
    meta["run_s"] = round(time.perf_counter() - started, 1)
    write_outputs("first_generation", rows, COLUMNS, args.out, meta, draw)
    print(f"target: a first generate() with nothing before within {TARGET:g}x of a warm one")
    for line in targets:
        print(f"  {line}")
    print(f"the whole run took {meta['run_s']:.0f} s")
    return 0


def draw(ax, rows):
    plot_grouped_bars(ax, rows, "batch", "first_over_warm", lambda batch: f"batch {batch}")
    ax.axhline(TARGET, color="gray", linestyle="--", linewidth=1)
    ax.set_ylabel("first generate() over a warm one")
    ax.set_title("The first generate() of a fresh process")


if __name__ == "__main__":
    sys.exit(main())
