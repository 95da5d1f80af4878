"""Decode-step latency of a Llama-style decoder whose attention is an eager break.

Variants, side by side in one run at each batch size: eager; breakgraph
(breakable: attention is an eager break); the same break structure as one
torch.cuda.CUDAGraph per segment (the peers' way); the same in Meta's
library (breakable_cuda_graphs, the ``bench`` extra: attention a
``@no_graph`` function writing into an output buffer; skipped with the
reason printed where it is not installed); the lower bound of the
breakable way, one monolithic torch.cuda.graph with the live length frozen
at capture; breakgraph's full mode for uniform decode (a GraphRunner key in
mode "full": attention's capturable variant, which reads positions from the
device, inside one graph); and the same work as one torch.cuda.graph, the
full mode's lower bound. Every variant is checked against eager on fresh
random inputs (outputs poisoned first) before it is timed. A step is timed
as an engine runs it: the live length changes, the step is launched, and the
host waits for the result (as it must to sample the next token).

At batch 1 the gap to the lower bound is split into what the host spends in
the eager attention calls, in graph launches, and the GPU's idle time.

The warm steps cycle through 16 live lengths, each seen before. Each
variant is also timed cold: the median of 8 steps, each at a length no step
of the run has had (``cold_step_ms``). The eager attention's shapes hold
the length, and SDPA's cuDNN backend (which torch prefers on an H100 with
a recent cuDNN; the run prints the backend it picked) builds a plan for
every new shape, so a sequence that grows pays that at each of its steps,
once per length and batch size. Full graphs, whose attention reads
positions from the device, and the frozen lower bound keep their shapes.

    python3 -m benchmarks.decode_step [--quick] [--out results] [--layers 16] [--batches 1 8 32 64]
"""

from __future__ import annotations

import itertools
import statistics
import time

import torch

import breakgraph as bg
from benchmarks.attention import attention, attention_backend
from benchmarks.common import benchmark_parser, device_meta, plot_grouped_bars, require_gpu, time_per_call_us, time_variants, write_outputs
from benchmarks.decode_step_variants import COLD_STEPS, LIVE_LENGTHS, VARIANTS, Step
from benchmarks.decoder import Decoder, DecoderConfig
from benchmarks.peers import load_meta, meta_ratios


def gap_breakdown(step: Step, us: dict, iters: int) -> dict:
    """At one batch size: where the breakgraph step's time over the lower bound goes.

    The GPU's busy time is the lower bound's step issued back to back (one
    launch per step, so the GPU never waits); the host's time in the eager
    attention calls is measured inside them, in a second capture whose break
    adds up its own time.
    """
    host_in_attention = [0.0]

    def timed_attention(*args):
        started = time.perf_counter()
        result = attention(*args)
        host_in_attention[0] += time.perf_counter() - started
        return result

    stream = torch.cuda.Stream()
    graph = bg.BreakableCUDAGraph(pool=step.graph.pool)
    with bg.BreakableCUDAGraphCapture(graph, stream=stream):
        step.decoder.step(step.x, step.positions, step.meta, bg.eager_on_graph(timed_attention))
    gpu_busy_us = time_per_call_us(step.monolithic.replay, iters)
    host_us = []
    lengths = itertools.cycle(LIVE_LENGTHS)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    host_in_attention[0] = 0.0
    for _ in range(iters):
        step.meta.length = next(lengths)
        started = time.perf_counter()
        graph.replay()
        host_us.append((time.perf_counter() - started) * 1e6)
        torch.cuda.synchronize()
    attention_us = host_in_attention[0] / iters * 1e6
    replay_host_us = statistics.mean(host_us)
    breakgraph_us, lower_us = us[VARIANTS[1]], us[VARIANTS[3]]
    return {
        "lower_bound_us": round(lower_us, 1),
        "breakgraph_us": round(breakgraph_us, 1),
        "gap_us": round(breakgraph_us - lower_us, 1),
        "gpu_busy_us": round(gpu_busy_us, 1),
        "gpu_idle_in_breakgraph_step_us": round(breakgraph_us - gpu_busy_us, 1),
        "host_replay_us": round(replay_host_us, 1),
        "host_in_eager_attention_us": round(attention_us, 1),
        "host_in_graph_launches_us": round(replay_host_us - attention_us, 1),
        "graph_segments": graph.num_graphs,
        "eager_breaks": graph.num_eager_breaks,
    }


def batch_rows(batch: int, us: dict, cold: dict, worst: dict) -> list[dict]:
    """One batch size's row per variant, from its warm and cold µs per step and its largest
    difference from eager, and the ratios row after them."""
    rows = [
        {
            "batch": batch,
            "variant": name,
            "step_ms": round(value / 1000, 3),
            "tokens_per_s": round(batch / value * 1e6),
            "cold_step_ms": round(cold[name] / 1000, 3),
            "cold_over_warm": round(cold[name] / value, 2),
            "max_abs_diff_vs_eager": round(worst[name], 4),
        }
        for name, value in us.items()
    ]
    ours, full = us[VARIANTS[1]], us[VARIANTS[4]]
    ratios = (
        f"breakgraph/lower bound {ours / us[VARIANTS[3]]:.2f}x; "
        f"torch-per-segment/breakgraph {us[VARIANTS[2]] / ours:.2f}x; "
        f"eager/breakgraph {us[VARIANTS[0]] / ours:.2f}x; "
        f"full/same-work monolithic {full / us[VARIANTS[5]]:.3f}x; "
        f"torch-per-segment/full {us[VARIANTS[2]] / full:.2f}x"
    )
    ratios += meta_ratios(us, {"breakgraph": ours, "full": full})
    ratios += f"; cold/warm step: breakgraph {cold[VARIANTS[1]] / ours:.2f}x, full {cold[VARIANTS[4]] / full:.2f}x"
    return rows + [{"batch": batch, "variant": "ratios", "step_ms": ratios}]


def main(argv=None) -> int:
    parser = benchmark_parser("decode_step", __doc__)
    parser.add_argument("--quick", action="store_true", help="small smoke run: 2 layers, batches 1 and 8")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=None)
    args = parser.parse_args(argv)
    require_gpu("decode_step")
    config = DecoderConfig(layers=args.layers or (2 if args.quick else 16))
    batches = args.batches or ([1, 8] if args.quick else [1, 8, 32, 64])
    iters = 10 if args.quick else 100

    decoder = Decoder(config, max_batch=max(batches))
    stream = torch.cuda.Stream()
    meta_library = load_meta()
    rows, breakdown = [], {}
    unseen = iter(range(LIVE_LENGTHS[0] - 1, 0, -1))  # lengths no step has had, nearest the warm ones first
    for batch in batches:
        step = Step(decoder, batch, stream, meta_library)
        worst = step.check()
        us = time_variants({name: step.timed(run) for name, run in step.runs().items()}, iters)
        rows += batch_rows(batch, us, step.cold_us(unseen), worst)
        if batch == batches[0]:
            breakdown = {"batch": batch, **gap_breakdown(step, us, iters)}
            backend = attention_backend(step.x.view(batch, config.heads, -1), decoder.k_cache[0][:batch], decoder.v_cache[0][:batch], LIVE_LENGTHS[0])
        del step
    meta = device_meta() | {"config": {k: str(v) for k, v in vars(config).items()}, "gap_breakdown": breakdown, "eager_attention_sdpa_backend": backend}
    columns = ["batch", "variant", "step_ms", "tokens_per_s", "cold_step_ms", "cold_over_warm", "max_abs_diff_vs_eager"]
    write_outputs("decode_step", rows, columns, args.out, meta, draw)
    print(
        f"cold_step_ms: the median of {COLD_STEPS} steps, each at a length the variant meets for the first time; "
        f"the eager attention runs on SDPA's {backend} backend"
    )
    print(f"where the gap to the lower bound goes at batch {breakdown['batch']} (µs per step):")
    for key, value in breakdown.items():
        print(f"  {key}: {value}")
    return 0


def draw(ax, rows):
    plot_grouped_bars(ax, rows, "batch", "step_ms", lambda batch: f"batch {batch}")
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    in_bar_order = sorted(rows, key=lambda r: (variants.index(r["variant"]), r["batch"]))  # as plot_grouped_bars draws
    centres = [patch.get_x() + patch.get_width() / 2 for patch in ax.patches]
    ax.scatter(centres, [r["cold_step_ms"] for r in in_bar_order], marker="_", s=120, color="black", label="first step at a new length")
    ax.set_yscale("log")
    ax.set_ylabel("step latency (ms, lower is better)")
    ax.set_title(f"Decode step, Llama-style decoder ({torch.cuda.get_device_name()})")


if __name__ == "__main__":
    raise SystemExit(main())
