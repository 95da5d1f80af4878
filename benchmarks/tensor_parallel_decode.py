"""The decode part of ``tensor_parallel``: every variant of the step on each rank's shard of the decoder.

``decode_step``'s :class:`Step` on a shard, with breakgraph's variants as an
engine serving the ranks calls them: through the GraphRunner, with and without
the ranks agreeing on each call's batch, and its graph replayed bare, so that
the runner's own cost shows. Checked and timed as ``decode_step`` checks and
times a step.
"""

from __future__ import annotations

import gc

import torch

import breakgraph as bg
from benchmarks.attention import AttentionMetadata, attention, attention_break, attention_from_positions
from benchmarks.common import time_variants, verdict
from benchmarks.decode_step_variants import FROZEN_LENGTH, LIVE_LENGTHS, VARIANTS, Step
from benchmarks.decoder import Decoder, DecoderConfig, MetaBreakable, TensorParallel, TorchPiecewise
from benchmarks.peers import META, load_meta
from benchmarks.tensor_parallel_ranks import checked_on_every_rank, on_every_rank
from breakgraph.base.runtime import run_on_stream

DECODE = "decode step"  # the part, as the table's "part" column names it
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

BREAKABLE_TARGET = 1.10  # breakable over its frozen-length bound, at most, at T = 2 and 4
FULL_TARGET = 1.02  # full mode over the same work as one monolithic graph, at most
PEER_TARGET = 1.00  # every peer's step over breakable's, at least


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
