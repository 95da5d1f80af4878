"""The benchmark decoder captured at many batch sizes, as an engine does at start-up.

An engine captures every batch size it serves before serving: the start-up,
memory and soak benchmarks measure that. Every way here captures from the same
max-size static inputs (:class:`BatchInputs`): breakgraph's GraphRunner, the
peers' graphs per size, one monolithic ``torch.cuda.graph`` per size; and
:func:`check_sizes` holds each way's replays to eager's output.
"""

from __future__ import annotations

import torch

import breakgraph as bg
from breakgraph.base.runtime import run_on_stream
from benchmarks.attention import AttentionMetadata, attention_break
from benchmarks.decoder import Decoder, TorchPiecewise, assert_matches_eager


class BatchInputs:
    """Max-size static inputs (hidden states, positions) and the step's metadata."""

    def __init__(self, decoder: Decoder, max_batch: int, length: int):
        self.decoder = decoder
        self.meta = AttentionMetadata(length)
        self.x = decoder.same_on_every_rank(torch.randn(max_batch, decoder.config.hidden, device="cuda", dtype=decoder.config.dtype))
        self.positions = torch.full((max_batch,), length, device="cuda", dtype=torch.long)

    def step_fn(self, attend):
        """``fn(x, positions)`` for the runner: a decoder step calling ``attend`` for attention."""
        return lambda x, positions: self.decoder.step(x, positions, self.meta, attend)

    def warm_up(self, sizes, stream: torch.cuda.Stream) -> None:
        """One eager step at every size on ``stream``: CUDA loads each kernel on first use, and
        cuBLAS makes the stream's workspace; neither belongs to any variant's capture."""

        def steps():
            for size in sizes:
                self.decoder.step(self.x[:size], self.positions[:size], self.meta)

        run_on_stream(stream, steps)
        torch.cuda.synchronize()

    def refill(self, size: int) -> torch.Tensor:
        """Fresh random hidden states in the first ``size`` rows; eager's output for them."""
        self.decoder.same_on_every_rank(self.x[:size].copy_(torch.randn_like(self.x[:size])))
        return self.decoder.step(self.x[:size], self.positions[:size], self.meta).clone()


def capture_breakgraph_sizes(inputs: BatchInputs, sizes, **runner_options) -> bg.GraphRunner:
    """breakgraph's way: one GraphRunner, largest size first, one shared pool (default options
    unless ``runner_options`` says otherwise)."""
    runner = bg.GraphRunner(inputs.step_fn(attention_break), (inputs.x, inputs.positions), sizes, progress=False, **runner_options)
    return runner.capture()


def capture_piecewise_sizes(inputs: BatchInputs, sizes, pool, stream, warmup: int = 1, way=TorchPiecewise) -> dict:
    """The peers' way: per size (largest first), warm up eagerly, then capture with ``way(pool)``
    (:class:`TorchPiecewise`, one graph per segment; or a :class:`MetaBreakable`)."""
    captured = {}
    for size in sorted(sizes, reverse=True):
        x, positions = inputs.x[:size], inputs.positions[:size]

        def warm_up():
            for _ in range(warmup):
                inputs.decoder.step(x, positions, inputs.meta)

        run_on_stream(stream, warm_up)
        piecewise = way(pool)
        output = piecewise.capture(lambda attend: inputs.decoder.step(x, positions, inputs.meta, attend), stream)
        captured[size] = (piecewise, output)
    return captured


def capture_monolithic_sizes(inputs: BatchInputs, sizes, pool, stream) -> dict:
    """Monolithic ``torch.cuda.graph`` per size (largest first) in one pool, length frozen at capture."""
    captured = {}
    for size in sorted(sizes, reverse=True):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            output = inputs.decoder.step(inputs.x[:size], inputs.positions[:size], inputs.meta)
        captured[size] = (graph, output)
    return captured


def check_sizes(inputs: BatchInputs, run, sizes) -> float:
    """Check ``run(size)`` (replay at ``size``, return the output) against eager on fresh inputs.

    The output is poisoned and the replay repeated, so an unwritten buffer
    shows. Returns the largest difference.
    """
    worst = 0.0
    for size in sizes:
        expected = inputs.refill(size)
        run(size).fill_(float("nan"))
        got = run(size)
        torch.cuda.synchronize()
        worst = max(worst, assert_matches_eager(got, expected, f"batch {size}"))
    return worst


def runner_replay(inputs: BatchInputs, runner: bg.GraphRunner):
    """``run(size)`` for :func:`check_sizes`: the runner on the first ``size`` rows of the inputs."""
    return lambda size: runner(inputs.x[:size].clone(), inputs.positions[:size].clone())


def graphs_replay(graphs: dict):
    """``run(size)`` for :func:`check_sizes` over {size: (graph with ``replay()``, output)}."""

    def run(size):
        graph, output = graphs[size]
        graph.replay()
        return output

    return run
