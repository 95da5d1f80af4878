"""One batch size of the decode step, captured every way ``decode_step`` compares.

The variants share the step's static inputs and its attention metadata, so
that one live length, moved on before each step as an engine moves it, drives
them all; :class:`Step` checks each against eager and times it that way, warm
and at lengths met for the first time. ``tensor_parallel`` runs the same
checks and timing on a rank's shard of the decoder.
"""

from __future__ import annotations

import itertools
import statistics

import torch

import breakgraph as bg
from breakgraph.base.runtime import run_on_stream
from benchmarks.attention import AttentionMetadata, attention, attention_break, attention_from_positions
from benchmarks.common import time_per_call_us
from benchmarks.decoder import Decoder, MetaBreakable, TorchPiecewise, assert_matches_eager
from benchmarks.peers import META

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
