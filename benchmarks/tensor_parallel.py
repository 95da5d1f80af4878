"""Tensor parallelism: the decode step, a runner's start-up and Hugging Face generation on T GPUs.

Run once per tensor-parallel size T, under torchrun (at T = 1 also without it):

    torchrun --nproc-per-node T -m benchmarks.tensor_parallel [--quick] [--out results] [--parts decoder capture hf]

Every rank runs the same work in the same order, so that the collectives
pair; rank 0 prints the table, the targets and each part's wall time, and
writes ``<out>/tensor_parallel_tp<T>.json`` and ``.png``; the other ranks
print nothing but errors. NVLink multicast is left off (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 unless set).

**decoder**: the benchmark decoder (``benchmarks/decoder.py``: 16 layers,
hidden 2048, 16 query and 4 KV heads, bf16, attention an eager break that
reads a host-side length) sharded Megatron-style (``TensorParallel``): each
rank holds heads / T query heads, kv_heads / T KV heads, its share of the
KV cache and of the MLP, and all-reduces the output and down projections'
partial sums inside the graph segments. Each rank's shard comes from a seed
of its own; every rank gets the same hidden states, broadcast from rank 0.
At batches 1, 8 and 32, ms per step:

- eager; torch CUDAGraph per segment; Meta ``breakable_cuda_graphs``
  (skipped, saying why, where it is not installed);
- *breakgraph breakable (runner)*: ``GraphRunner(step, ..., group=WORLD,
  agree_batches=False)`` called on the step's inputs (the ranks get one
  batch, as from one scheduler); the targets are measured on this row;
- *(runner, batches agreed)*: the same with the default
  ``agree_batches=True``, one gloo all_reduce per call;
- *(bare replay)*: that runner's ``BreakableCUDAGraph`` replayed directly,
  so that the runner's own cost shows;
- the lower bound: one ``torch.cuda.graph`` of the step, length frozen;
- *breakgraph full (runner)*: a runner in mode "full" (attention's
  capturable variant, a Triton split-K kernel, inline), called as above,
  and its graph replayed bare; its bound, the same work as one
  ``torch.cuda.graph``.

Every variant is checked against eager on fresh inputs, outputs poisoned
first, then timed as ``decode_step`` times a step (``Step.timed``: the live
length moves on, the step runs, the host waits), interleaved. Targets:
breakable at most 1.10x its bound at T = 2 and 4; full at most 1.02x its
bound; every peer's step at least 1.00x breakable's.

**capture**: the decoder captured by a runner at the default sizes up to 32,
with ``group=WORLD`` (the ranks agree once, as the capture ends) and without, in turns
after an untimed round; medians, each run the slowest rank's time from
making the runner to its graphs being ready. Target: agreement adds at most 5 %.

**hf**: a Llama-3.2-1B-shaped bf16 model with random weights: rank 0 writes
it with ``save_pretrained``, every rank loads it tensor parallel by the
model's own plan (``from_pretrained(..., tp_plan="auto")``; at T = 1 whole).
Warm decode tokens/s at batches 1 and 8, as ``transformers_generate``
measures them (a generation less a one-token generation, over
batch * (new - 1) tokens): transformers eager,
transformers static cache + torch.compile (a variant that raises is
reported failed with its error's first line), and ``hf.Generator`` in
breakable mode, full mode and breakable with ``compile=True``; how many
greedy tokens of each equal eager's (bf16 paths may part after a near-tie).
Target: the best breakgraph variant at least 1.3x torch.compile's tokens/s.

A part that fails on any rank is reported as failed on every rank, and the
others still run (the exit status is then 1). ``--quick`` is a smoke run:
batches 1 and 8, fewer steps and runs, a 2-layer Llama, 16 new tokens.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

from benchmarks.common import benchmark_parser, device_meta, plot_grouped_bars, require_gpu, write_outputs
from benchmarks.decoder import DecoderConfig
from benchmarks.tensor_parallel_capture import CAPTURE, capture_part
from benchmarks.tensor_parallel_decode import DECODE, decoder_part
from benchmarks.tensor_parallel_hf import GENERATE, hf_part
from benchmarks.tensor_parallel_ranks import on_every_rank, start

PARTS = ("decoder", "capture", "hf")
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
COLUMNS = ["part", "batch", "variant", "ms", "tokens_per_s", "max_abs_diff_vs_eager", "same_as_eager", "notes"]
SHOWN = dict(zip(PARTS, (DECODE, CAPTURE, GENERATE)))  # each part as the table's "part" column names it


def parse(argv) -> argparse.Namespace:
    parser = benchmark_parser("tensor_parallel", __doc__, command="torchrun --nproc-per-node T -m benchmarks.tensor_parallel")
    parser.add_argument("--quick", action="store_true", help="smoke run: batches 1 and 8, fewer steps, a 2-layer Llama")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="what to measure (default: all three)")
    parser.add_argument("--layers", type=int, default=16, help="the decoder's layers (16)")
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="the decode step's batch sizes (1 8 32)")
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens of the hf part (128)")
    parser.add_argument("--new", type=int, default=None, help="new tokens of the hf part (64)")
    args = parser.parse_args(argv)
    args.batches = args.batches or ([1, 8] if args.quick else [1, 8, 32])
    args.prompt = (16 if args.quick else 128) if args.prompt is None else args.prompt
    args.new = (16 if args.quick else 64) if args.new is None else args.new
    if args.new < 2:
        parser.error(f"argument --new: must be at least 2 (the prefill makes the first new token), got {args.new}")
    if args.prompt < 1:
        parser.error(f"argument --prompt: must be at least 1, got {args.prompt}")
    # steps per timed block and blocks per variant (decoder); runner start-ups each way (capture);
    # warm generations per variant and batch (hf)
    args.iters, args.rounds, args.turns, args.repeats = (10, 3, 3, 2) if args.quick else (30, 7, 15, 3)
    return args


def main(argv=None) -> int:
    started = time.perf_counter()
    args = parse(argv)
    require_gpu("tensor_parallel")
    for name, value in NO_MULTICAST.items():
        os.environ.setdefault(name, value)
    tp = start()
    if tp.rank:  # the same work, in silence but for errors
        sys.stdout = open(os.devnull, "w")
        warnings.simplefilter("ignore")
    config = DecoderConfig(layers=args.layers)
    parts = {"decoder": lambda: decoder_part(config, args, tp), "capture": lambda: capture_part(config, args, tp), "hf": lambda: hf_part(args, tp)}
    rows, targets, meta = [], [], {"tensor_parallel": tp.world, "nccl": str(torch.cuda.nccl.version())}
    seconds = {"start": time.perf_counter() - started}
    failed = []
    for part in (part for part in PARTS if part in args.parts):
        begun = time.perf_counter()
        measured, why = on_every_rank(parts[part], tp, whole_traceback=True)  # a part that fails leaves the others' results
        if why is None:
            part_rows, lines, meta[part] = measured
        else:
            part_rows, lines = [{"part": SHOWN[part], "variant": "failed", "notes": why}], [f"the {part} part failed: {why}"]
            failed.append(part)
        rows, targets, seconds[part] = rows + part_rows, targets + lines, time.perf_counter() - begun
    seconds["total"] = time.perf_counter() - started
    if tp.rank == 0:
        meta = device_meta() | meta | {"targets": targets, "seconds": {part: round(value, 1) for part, value in seconds.items()}}
        write_outputs(f"tensor_parallel_tp{tp.world}", rows, COLUMNS, args.out, meta, lambda ax, measured: draw(ax, measured, tp.world))
        print(f"targets at tensor parallel {tp.world}:")
        for line in targets:
            print(f"  {line}")
        print("wall time: " + ", ".join(f"{part} {value:.1f} s" for part, value in seconds.items()))
    gc.collect()  # graphs that captured collectives go before the process group (NCCL waits for them)
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed and tp.rank == 0 else 0  # one rank says so: torchrun ends the others at the first that fails


def draw(ax, rows, world: int):
    """The first part measured: its variants' bars per batch."""
    for part, y, label, log in (
        (DECODE, "ms", "step latency (ms, lower is better)", True),
        (GENERATE, "tokens_per_s", "decode tokens/s (higher is better)", True),
        (CAPTURE, "ms", "ms to make and capture the runner (lower is better)", False),
    ):
        mine = [row for row in rows if row["part"] == part and isinstance(row.get(y), (int, float))]
        if mine:
            break
    else:
        return
    groups = {row["batch"] for row in mine}
    every = [v for v in dict.fromkeys(row["variant"] for row in mine) if len({r["batch"] for r in mine if r["variant"] == v}) == len(groups)]
    plot_grouped_bars(ax, [row for row in mine if row["variant"] in every], "batch", y, lambda batch: f"batch {batch}" if part != CAPTURE else batch)
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(label)
    ax.set_title(f"{part.capitalize()}, tensor parallel {world} ({torch.cuda.get_device_name()})")


if __name__ == "__main__":
    raise SystemExit(main())
