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
import functools
import gc
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
import warnings

import torch
import torch.distributed as dist

import breakgraph as bg
from benchmarks.common import benchmark_parser, device_meta, plot_grouped_bars, require_gpu, time_variants, write_outputs
from benchmarks.decode_step import FROZEN_LENGTH, LIVE_LENGTHS, VARIANTS, Step
from benchmarks.decoder import (
    AttentionMetadata,
    BatchInputs,
    Decoder,
    DecoderConfig,
    MetaBreakable,
    TensorParallel,
    TorchPiecewise,
    attention,
    attention_break,
    attention_from_positions,
    check_sizes,
    runner_replay,
)
from benchmarks.peers import META, load_meta
from breakgraph.runtime import run_on_stream

PARTS = ("decoder", "capture", "hf")
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
COLUMNS = ["part", "batch", "variant", "ms", "tokens_per_s", "max_abs_diff_vs_eager", "same_as_eager", "notes"]
DECODE, CAPTURE, GENERATE = "decode step", "capture", "generate"
SHOWN = dict(zip(PARTS, (DECODE, CAPTURE, GENERATE)))  # each part as the table's "part" column names it

EAGER = VARIANTS[0]  # the names Step.check knows eager and the bound by
TORCH = "torch CUDAGraph per segment"
BREAKABLE = "breakgraph breakable (runner)"
AGREED = "breakgraph breakable (runner, batches agreed)"
BARE = "breakgraph breakable (bare replay)"
BOUND = VARIANTS[3]
FULL = "breakgraph full (runner)"
FULL_BARE = "breakgraph full (bare replay)"
FULL_BOUND = "monolithic graph, same work as full mode"
PEERS = {TORCH: "torch per segment", META: "meta"}

WITH_GROUP = "GraphRunner(..., group=WORLD)"
WITHOUT_GROUP = "GraphRunner without group"

HF = {
    "eager": "transformers eager",
    "compile": "transformers static + torch.compile",
    "breakable": "breakgraph breakable",
    "full": "breakgraph full",
    "breakable_compile": "breakgraph breakable + compile",
}
OURS = ("breakable", "full", "breakable_compile")
HF_BATCHES = (1, 8)

BREAKABLE_TARGET = 1.10  # breakable over its frozen-length bound, at most, at T = 2 and 4
FULL_TARGET = 1.02  # full mode over the same work as one monolithic graph, at most
PEER_TARGET = 1.00  # every peer's step over breakable's, at least
AGREEMENT_TARGET = 1.05  # a runner's start-up with group over without, at most
DECODE_TARGET = 1.3  # the best breakgraph variant's decode tokens/s over torch.compile's, at least


def verdict(ratio: float, target: float, at_most: bool) -> str:
    return "met" if (ratio <= target if at_most else ratio >= target) else "NOT met"


class RanksFailed(Exception):
    """A failure every rank raises alike; its message names the rank it came from."""


def on_every_rank(work, tp: TensorParallel, whole_traceback: bool = False) -> tuple[object, str | None]:
    """``(work(), None)`` where it succeeded on every rank, else ``(None, why)`` on every rank: the
    first line of the first failed rank's error, and that rank. A rank that fails says so on
    stderr (the whole traceback if ``whole_traceback``). Ranks that fail at different points
    may leave the others waiting in a collective, until the process group's timeout."""
    result, error = None, None
    try:
        result = work()
    except Exception as caught:  # reported in the table; the run goes on
        first = (str(caught).strip().splitlines() or [""])[0]
        error = first if isinstance(caught, RanksFailed) else f"{type(caught).__name__}: {first} (rank {tp.rank})"
        print(f"[rank {tp.rank}] {traceback.format_exc() if whole_traceback else error}", file=sys.stderr, flush=True)
    failed = torch.zeros(1, device="cuda")
    failed += error is not None
    dist.all_reduce(failed, group=tp.group)
    if not failed.item():
        return result, None
    errors = [None] * tp.world
    dist.all_gather_object(errors, error, group=tp.group)
    return None, next(why for why in errors if why is not None)


def checked_on_every_rank(check, tp: TensorParallel):
    """``check()``'s result, or its failure raised on every rank: a rank that raised alone would
    pair its next collective with the others' next step. ``check`` must run every collective
    before it raises."""
    result, why = on_every_rank(check, tp, whole_traceback=True)
    if why is not None:
        raise RanksFailed(why)
    return result


# -- the decode step -------------------------------------------------------------------


class ShardedStep(Step):
    """``decode_step``'s Step on this rank's shard of the decoder: every variant captured at one
    batch size, the runners serving the ranks of ``group``; checked by :meth:`Step.check` and
    timed by :meth:`Step.timed`."""

    def __init__(self, decoder: Decoder, batch: int, stream: torch.cuda.Stream, meta_library, group):
        self.decoder = decoder
        self.meta = AttentionMetadata(LIVE_LENGTHS[0])
        self.frozen = AttentionMetadata(FROZEN_LENGTH)
        self.x = decoder.same_on_every_rank(torch.randn(batch, decoder.config.hidden, device="cuda", dtype=decoder.config.dtype))
        self.positions = torch.full((batch,), self.meta.length, device="cuda", dtype=torch.long)
        self.full_meta = AttentionMetadata(LIVE_LENGTHS[0], positions=self.positions)  # what full graphs read
        run_on_stream(stream, lambda: decoder.step(self.x, self.positions, self.meta))  # cuBLAS, NCCL, first loads

        def runner(meta, **options):
            # The step's own buffers are the runner's static inputs: a call copies nothing in.
            made = bg.GraphRunner(
                lambda x, positions: decoder.step(x, positions, meta, attention_break), (self.x, self.positions),
                capture_sizes=[batch], group=group, progress=False, **options,
            ).capture()
            return made, made(self.x, self.positions)  # the static output every call returns

        self.runner, self.out_runner = runner(self.meta, agree_batches=False)
        self.agreed, self.out_agreed = runner(self.meta)
        self.full, self.out_full = runner(self.full_meta, modes="full", agree_batches=False)
        self.graph, self.full_graph = self.runner.graphs[(None, batch)], self.full.graphs[(None, batch)]
        assert self.full_graph.num_graphs == 1 and self.full_graph.num_eager_breaks == 0

        self.piecewise = TorchPiecewise(torch.cuda.graph_pool_handle())
        self.out_piecewise = self.piecewise.capture(lambda attend: decoder.step(self.x, self.positions, self.meta, attend), stream)
        self.monolithic = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.monolithic, stream=stream):
            self.out_monolithic = decoder.step(self.x, self.positions, self.frozen, attention)
        self.masked = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.masked, stream=stream):
            self.out_masked = decoder.step(self.x, self.positions, self.full_meta, attention_from_positions)
        self.outputs = [self.out_runner, self.out_agreed, self.out_full, self.out_piecewise, self.out_monolithic, self.out_masked]
        self.meta_breakable = None
        if meta_library is not None:  # the peer's capture may fail where ours does not: then it is skipped
            captured, why = on_every_rank(lambda: self._capture_meta(meta_library, stream), decoder.tp, decoder.tp.rank == 0)
            if why is not None:
                print(f"skipping the variant {META!r} at batch {batch}: its capture failed ({why})")
            else:
                self.meta_breakable, self.out_meta_breakable = captured
                self.outputs.append(self.out_meta_breakable)

    def _capture_meta(self, library, stream):
        graph = MetaBreakable(library)
        return graph, graph.capture(lambda attend: self.decoder.step(self.x, self.positions, self.meta, attend), stream)

    def runs(self) -> dict:
        """Each variant's step: launch it and return its output."""
        runs = {EAGER: lambda: self.decoder.step(self.x, self.positions, self.meta)}
        runs[TORCH] = lambda: (self.piecewise.replay(), self.out_piecewise)[1]
        if self.meta_breakable is not None:
            runs[META] = lambda: (self.meta_breakable.replay(), self.out_meta_breakable)[1]
        runs[BREAKABLE] = lambda: self.runner(self.x, self.positions)
        runs[AGREED] = lambda: self.agreed(self.x, self.positions)
        runs[BARE] = lambda: (self.graph.replay(), self.out_runner)[1]
        runs[BOUND] = lambda: (self.monolithic.replay(), self.out_monolithic)[1]
        runs[FULL] = lambda: self.full(self.x, self.positions)
        runs[FULL_BARE] = lambda: (self.full_graph.replay(), self.out_full)[1]
        runs[FULL_BOUND] = lambda: (self.masked.replay(), self.out_masked)[1]
        return runs


def decode_ratios(batch: int, us: dict, world: int) -> tuple[dict, list[str]]:
    """The batch's ratios row and its target lines, from each variant's µs per step."""
    ours = us[BREAKABLE]
    breakable, full = ours / us[BOUND], us[FULL] / us[FULL_BOUND]
    peers = {name: us[name] / ours for name in PEERS if name in us}
    notes = [f"breakable/bound {breakable:.2f}x", f"full/same-work monolithic {full:.3f}x"]
    notes += [f"{PEERS[name]}/breakable {ratio:.2f}x" for name, ratio in peers.items()]
    notes += [
        f"runner/bare replay {ours / us[BARE]:.3f}x",
        f"batches agreed/runner {us[AGREED] / ours:.3f}x",
        f"full bare/same-work monolithic {us[FULL_BARE] / us[FULL_BOUND]:.3f}x",
        f"eager/breakable {us[EAGER] / ours:.2f}x",
    ]
    row = {"part": DECODE, "batch": batch, "variant": "ratios", "notes": "; ".join(notes)}
    applies = verdict(breakable, BREAKABLE_TARGET, at_most=True) if world > 1 else f"the target is set for T = 2 and 4, this is T = {world}"
    # What a breakable graph with no library code between its segments takes over the same bound.
    floor = f"; torch's per-segment graphs: {us[TORCH] / us[BOUND]:.2f}x" if TORCH in us else ""
    lines = [
        f"batch {batch}: breakgraph breakable {breakable:.2f}x its frozen-length bound (target <= {BREAKABLE_TARGET:.2f}x: {applies}{floor})",
        f"batch {batch}: breakgraph full {full:.3f}x the same work as one monolithic graph "
        f"(target <= {FULL_TARGET:.2f}x: {verdict(full, FULL_TARGET, at_most=True)})",
    ]
    lines += [
        f"batch {batch}: {name} {ratio:.2f}x breakgraph breakable's step (target >= {PEER_TARGET:.2f}x: {verdict(ratio, PEER_TARGET, at_most=False)})"
        for name, ratio in peers.items()
    ]
    return row, lines


def decoder_part(config: DecoderConfig, args, tp: TensorParallel) -> tuple[list, list, dict]:
    decoder = Decoder(config, max_batch=max(args.batches), tp=tp)
    stream = torch.cuda.Stream()
    meta_library = load_meta()
    rows, lines = [], []
    for batch in args.batches:
        step = ShardedStep(decoder, batch, stream, meta_library, tp.group)
        worst = checked_on_every_rank(step.check, tp)
        us = time_variants({name: step.timed(run) for name, run in step.runs().items()}, args.iters, args.rounds)
        for name, value in us.items():
            rows.append({
                "part": DECODE, "batch": batch, "variant": name, "ms": round(value / 1000, 3),
                "tokens_per_s": round(batch / value * 1e6), "max_abs_diff_vs_eager": round(worst[name], 4),
            })
        row, batch_lines = decode_ratios(batch, us, tp.world)
        rows.append(row)
        lines += batch_lines
        del step
        gc.collect()
    about = {"config": {k: str(v) for k, v in vars(config).items()}, "batches": args.batches, "steps_per_round": args.iters, "rounds": args.rounds}
    return rows, lines, about


# -- a runner's start-up, with and without agreement --------------------------------------


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


# -- Hugging Face generation ------------------------------------------------------------


def checkpoint_folder(tp: TensorParallel, needed_bytes: int) -> str:
    """A new folder every rank of this host can read, named by rank 0: in shared memory where it has room."""
    folder = [None]
    if tp.rank == 0:
        room = os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 2 * needed_bytes
        folder[0] = tempfile.mkdtemp(prefix="breakgraph-tp-", dir="/dev/shm" if room else None)
    dist.broadcast_object_list(folder, src=dist.get_global_rank(tp.group, 0), group=tp.group)
    return folder[0]


def checkpoint_bytes(shape: dict) -> int:
    """What ``save_pretrained`` writes for the Llama of ``shape`` in bf16 (tied embeddings written once)."""
    hidden, heads = shape["hidden_size"], shape["num_attention_heads"]
    head_dim = shape.get("head_dim") or hidden // heads
    attention = 2 * hidden * heads * head_dim + 2 * hidden * shape["num_key_value_heads"] * head_dim
    layer = attention + 3 * hidden * shape["intermediate_size"] + 2 * hidden
    embeddings = shape["vocab_size"] * hidden * (1 if shape.get("tie_word_embeddings") else 2)
    return 2 * (embeddings + shape["num_hidden_layers"] * layer + hidden)


def load_model(shape: dict, tp: TensorParallel):
    """The Llama of ``shape``, random weights in bf16: written by rank 0, loaded by every rank (its shard)."""
    from transformers import AutoModelForCausalLM

    from benchmarks.transformers_generate import build_model

    folder = checkpoint_folder(tp, checkpoint_bytes(shape))
    try:
        if tp.rank == 0:
            built = build_model(shape, torch.bfloat16)
            built.save_pretrained(folder)
            del built
            torch.cuda.empty_cache()
        dist.barrier()
        split = {"tp_plan": "auto"} if tp.world > 1 else {"device_map": torch.device("cuda", torch.cuda.current_device())}
        with warnings.catch_warnings():  # transformers 5.17 on would take the plan in a DistributedConfig
            warnings.filterwarnings("ignore", message="Passing `tp_plan` directly", category=FutureWarning)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, **split)
        dist.barrier()
    finally:
        if tp.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = None
    return model.eval()


def make_generate(variant: str, model, max_length: int, batches):
    """``generate(input_ids, new_tokens) -> tokens``, the variant's way."""
    from breakgraph import hf

    if variant in ("eager", "compile"):
        extra = {"cache_implementation": "static"} if variant == "compile" else {}

        def generate(ids, new):
            return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, **extra)

        return generate
    mode, _, how = variant.partition("_")
    model.set_attn_implementation(hf.ATTENTION)
    generator = hf.Generator(
        model, max_length=max_length, max_batch_size=max(batches), capture_sizes=sorted(batches), mode=mode,
        progress=False, compile=how == "compile",
    )
    return generator.generate


def warm_decode(generate, ids: torch.Tensor, new: int, repeats: int) -> dict:
    """Warm decode tokens/s as ``transformers_generate`` measures it, and the last generation's new tokens."""
    from benchmarks.transformers_generate import timed

    batch, prompt = ids.shape
    generate(ids, new)  # the first: compiles, captures, first uses of shapes
    generate(ids, 1)  # a one-token generation's first call is cold too
    full, one = [], []
    for _ in range(repeats):
        seconds, tokens = timed(lambda: generate(ids, new))
        full.append(seconds)
        one.append(timed(lambda: generate(ids, 1))[0])
    decode_s = statistics.median(full) - statistics.median(one)
    return {"decode_tok_s": batch * (new - 1) / decode_s, "ms_per_step": decode_s / (new - 1) * 1e3, "tokens": tokens[:, prompt:].tolist()}


def generate_ratios(batch: int, measured: dict, failed: dict, compiled: bool, world: int) -> tuple[dict, list[str]]:
    """The batch's ratios row and target line from {variant: result} and {variant: why it failed}."""
    ours = [variant for variant in OURS if variant in measured]
    row = {"part": GENERATE, "batch": batch, "variant": "ratios"}
    if "compile" not in measured:
        why = failed.get("compile", "not measured")
        row["notes"] = f"no torch.compile figure to compare with ({why})"
        return row, [f"batch {batch}: transformers static + torch.compile failed at T = {world} ({why}): no ratio"]
    if not ours:
        row["notes"] = "no breakgraph variant ran"
        return row, [f"batch {batch}: no breakgraph variant ran: no ratio"]
    reference = measured["compile"]["decode_tok_s"]
    row["notes"] = "; ".join(f"{variant}/compile {measured[variant]['decode_tok_s'] / reference:.2f}x" for variant in ours)
    best = max(ours, key=lambda variant: measured[variant]["decode_tok_s"])
    ratio = measured[best]["decode_tok_s"] / reference
    line = (
        f"batch {batch}: best breakgraph variant {HF[best]}: {ratio:.2f}x torch.compile's decode tokens/s "
        f"(target >= {DECODE_TARGET:g}x: {verdict(ratio, DECODE_TARGET, at_most=False)})"
    )
    if not compiled:
        line += "; transformers did not compile its static-cache generation, so its figure is uncompiled"
    return row, [line]


def measure_generation(variant: str, model, ids: dict, args, tp: TensorParallel) -> tuple[dict, dict]:
    """One variant's results at each batch size of ``ids`` ({batch: prompts}), and why it has none
    at the others: a failure ends the variant, since it would fail again, slowly."""
    loud = tp.rank == 0  # rank 0 prints a failure's traceback, the others its first line
    generate, why = on_every_rank(lambda: make_generate(variant, model, args.prompt + args.new, list(ids)), tp, loud)
    results, failures = {}, {}
    for batch, prompt_ids in ids.items():
        if why is None:
            result, why = on_every_rank(lambda: warm_decode(generate, prompt_ids, args.new, args.repeats), tp, loud)
            if why is None:
                results[batch] = result
                continue
            failures[batch] = why
            why = f"not tried after failing at batch {batch}"
        else:
            failures[batch] = why
    return results, failures


def hf_part(args, tp: TensorParallel) -> tuple[list, list, dict]:
    import transformers

    from benchmarks.transformers_generate import agreement, prompts
    from breakgraph import hf

    transformers.logging.disable_progress_bar()
    if tp.rank:
        transformers.logging.set_verbosity_error()
    shape = dict(hf.LLAMA_3_2_1B, num_hidden_layers=2) if args.quick else hf.LLAMA_3_2_1B
    model = load_model(shape, tp)
    ids = {batch: prompts(batch, args.prompt, shape["vocab_size"], seed=batch) for batch in HF_BATCHES}
    measured = {batch: {} for batch in HF_BATCHES}
    failed = {batch: {} for batch in HF_BATCHES}
    for variant in HF:
        results, failures = measure_generation(variant, model, ids, args, tp)
        for batch, result in results.items():
            measured[batch][variant] = result
        for batch, why in failures.items():
            failed[batch][variant] = why
        if variant == "compile":
            torch._dynamo.reset()  # its compiled code and cudagraph trees, done with
        gc.collect()  # a Generator and its graphs
        torch.cuda.empty_cache()
    compiled = hasattr(model, "_compiled_call")  # transformers compiled its static-cache generation
    rows, lines = [], []
    for batch in HF_BATCHES:
        reference = measured[batch].get("eager", {}).get("tokens")
        for variant in HF:
            row = {"part": GENERATE, "batch": batch, "variant": HF[variant]}
            if variant in measured[batch]:
                result = measured[batch][variant]
                row |= {"ms": round(result["ms_per_step"], 3), "tokens_per_s": round(result["decode_tok_s"], 1)}
                row["same_as_eager"] = agreement(result["tokens"], reference) if reference and variant != "eager" else "-"
            else:
                row |= {"ms": "failed", "notes": failed[batch][variant]}
            rows.append(row)
        row, batch_lines = generate_ratios(batch, measured[batch], failed[batch], compiled, tp.world)
        rows.append(row)
        lines += batch_lines
    about = {"model": "Llama-3.2-1B shape" + (", 2 layers" if args.quick else ""), "prompt": args.prompt, "new": args.new,
             "repeats": args.repeats, "transformers": transformers.__version__, "transformers_compiled": compiled}
    return rows, lines, about


# -- the run ----------------------------------------------------------------------------


def start() -> TensorParallel:
    """Join the NCCL process group on this rank's GPU: torchrun's, or a group of one."""
    local = int(os.environ.get("LOCAL_RANK", 0))
    if local >= torch.cuda.device_count():
        print(f"python3 -m benchmarks.tensor_parallel: rank {local} of this host has no GPU of its own "
              f"({torch.cuda.device_count()} visible): start at most that many ranks; nothing was measured", file=sys.stderr)
        raise SystemExit(2)
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    if "RANK" in os.environ:  # torchrun's
        dist.init_process_group("nccl", device_id=device)
    else:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0, device_id=device)
    return TensorParallel(dist.get_rank(), dist.get_world_size(), dist.group.WORLD)


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
