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
from breakgraph.runtime import run_on_stream
from benchmarks.common import benchmark_parser, device_meta, plot_grouped_bars, require_gpu, time_per_call_us, time_variants, write_outputs
from benchmarks.decoder import (
    AttentionMetadata,
    Decoder,
    DecoderConfig,
    MetaBreakable,
    TorchPiecewise,
    assert_matches_eager,
    attention,
    attention_backend,
    attention_break,
    attention_from_positions,
)
from benchmarks.peers import META, load_meta, meta_ratios

LIVE_LENGTHS = range(1008, 1024)  # tokens in the cache before the step; the step attends over one more
FROZEN_LENGTH = 1015  # the lower bound's length, the live lengths' middle
COLD_STEPS = 8  # cold steps timed per variant, each at a length no step has had before

VARIANTS = (
    "eager",
    "breakgraph",
    "torch CUDAGraph per segment",
    "lower bound: monolithic graph, frozen length",
    "breakgraph full mode (runner, uniform decode)",
    "monolithic graph, same work as full mode",
)


class Step:
    """Static inputs of one batch size and every variant's captured form (Meta's library's
    where ``meta_library`` is the module, not None)."""

    def __init__(self, decoder: Decoder, batch: int, stream: torch.cuda.Stream, meta_library):
        hidden = decoder.config.hidden
        self.decoder = decoder
        self.meta = AttentionMetadata(LIVE_LENGTHS[0])
        self.frozen = AttentionMetadata(FROZEN_LENGTH)
        self.x = torch.randn(batch, hidden, device="cuda", dtype=decoder.config.dtype)
        self.positions = torch.full((batch,), self.meta.length, device="cuda", dtype=torch.long)

        # Warm up: cuBLAS handles, kernels' first loads.
        run_on_stream(stream, lambda: decoder.step(self.x, self.positions, self.meta))

        self.graph = bg.BreakableCUDAGraph()
        with bg.BreakableCUDAGraphCapture(self.graph, stream=stream):
            self.out_breakgraph = decoder.step(self.x, self.positions, self.meta, attention_break)

        self.piecewise = TorchPiecewise(torch.cuda.graph_pool_handle())
        self.out_piecewise = self.piecewise.capture(
            lambda attend: decoder.step(self.x, self.positions, self.meta, attend), stream
        )

        self.monolithic = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.monolithic, stream=stream):
            self.out_monolithic = decoder.step(self.x, self.positions, self.frozen, attention)

        # Full mode through the runner: uniform decode batches (every row at the same length).
        self.full_meta = AttentionMetadata(LIVE_LENGTHS[0], positions=self.positions)
        runner = bg.GraphRunner(
            lambda x, positions: decoder.step(x, positions, self.full_meta, attention_break),
            (self.x, self.positions),
            capture_sizes=[batch],
            modes="full",
            progress=False,
        ).capture()
        self.full = runner.graphs[(None, batch)]
        assert self.full.num_graphs == 1 and self.full.num_eager_breaks == 0
        self.out_full = runner(self.x, self.positions)  # the static output the graph writes

        self.masked = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.masked, stream=stream):
            self.out_masked = decoder.step(self.x, self.positions, self.full_meta, attention_from_positions)

        self.outputs = [self.out_breakgraph, self.out_piecewise, self.out_monolithic, self.out_full, self.out_masked]
        self.meta_breakable = None
        if meta_library is not None:
            self.meta_breakable = MetaBreakable(meta_library)
            self.out_meta_breakable = self.meta_breakable.capture(
                lambda attend: decoder.step(self.x, self.positions, self.meta, attend), stream
            )
            self.outputs.append(self.out_meta_breakable)

    def runs(self) -> dict:
        """Each variant's step: launch it and return its output."""
        runs = {
            VARIANTS[0]: lambda: self.decoder.step(self.x, self.positions, self.meta),
            VARIANTS[1]: lambda: (self.graph.replay(), self.out_breakgraph)[1],
            VARIANTS[2]: lambda: (self.piecewise.replay(), self.out_piecewise)[1],
            VARIANTS[3]: lambda: (self.monolithic.replay(), self.out_monolithic)[1],
            VARIANTS[4]: lambda: (self.full.replay(), self.out_full)[1],
            VARIANTS[5]: lambda: (self.masked.replay(), self.out_masked)[1],
        }
        if self.meta_breakable is not None:
            runs[META] = lambda: (self.meta_breakable.replay(), self.out_meta_breakable)[1]
        return runs

    def check(self, trials: int = 2) -> dict:
        """Compare every variant with eager on fresh inputs (the same on every tensor-parallel
        rank); return each one's largest difference. Every variant runs before a difference is
        raised, so that tensor-parallel ranks' collectives stay paired."""
        runs = self.runs()
        worst = dict.fromkeys(runs, 0.0)
        failures = []
        for trial in range(trials):
            for name, run in runs.items():
                if name == VARIANTS[0]:
                    continue
                meta = self.frozen if name == VARIANTS[3] else self.meta
                if meta is self.meta:
                    meta.length = LIVE_LENGTHS[(5 * trial + 3) % len(LIVE_LENGTHS)]
                self.decoder.same_on_every_rank(self.x.copy_(torch.randn_like(self.x)))
                self.positions.fill_(meta.length)
                expected = self.decoder.step(self.x, self.positions, meta).clone()
                for output in self.outputs:
                    output.fill_(float("nan"))
                got = run()
                torch.cuda.synchronize()
                try:
                    worst[name] = max(worst[name], assert_matches_eager(got, expected, name))
                except AssertionError as failure:
                    failures.append(str(failure))
        if failures:
            tp = self.decoder.tp
            rank = f"rank {tp.rank}, " if tp.world > 1 else ""
            raise AssertionError(f"{rank}batch {self.x.shape[0]}: " + "; ".join(failures))
        return worst

    def timed(self, run, lengths=LIVE_LENGTHS):
        """An engine's step: the live length moves on (cycling through ``lengths``), the step runs,
        the host waits for its output."""
        lengths = itertools.cycle(lengths)
        meta = self.meta

        def step():
            meta.length = next(lengths)
            self.positions.fill_(meta.length)  # the device's copy, which full graphs read
            run()
            torch.cuda.synchronize()

        return step

    def cold_us(self, unseen) -> dict:
        """Each variant's median step at lengths met for the first time (taken from the iterator
        ``unseen``, ``COLD_STEPS`` each), µs.

        A kernel library may prepare a kernel per shape on first use (cuDNN's
        attention builds a plan), and the eager attention's shapes hold the
        length: the warm steps cycle through lengths seen before, but a
        sequence that grows meets a new one at every step. Each variant takes
        lengths of its own, so none finds what another prepared.
        """
        cold = {}
        for name, run in self.runs().items():
            step = self.timed(run, [next(unseen) for _ in range(COLD_STEPS)])
            cold[name] = statistics.median(time_per_call_us(step, iters=1, repeats=1) for _ in range(COLD_STEPS))
        return cold


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
        cold = step.cold_us(unseen)
        for name, value in us.items():
            rows.append(
                {
                    "batch": batch,
                    "variant": name,
                    "step_ms": round(value / 1000, 3),
                    "tokens_per_s": round(batch / value * 1e6),
                    "cold_step_ms": round(cold[name] / 1000, 3),
                    "cold_over_warm": round(cold[name] / value, 2),
                    "max_abs_diff_vs_eager": round(worst[name], 4),
                }
            )
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
        rows.append({"batch": batch, "variant": "ratios", "step_ms": ratios})
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
