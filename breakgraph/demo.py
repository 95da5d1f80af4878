"""``python3 -m breakgraph demo``: capture a small transformer whose attention is an eager break."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import breakgraph as bg
from breakgraph import diagnostics
from breakgraph.base import runtime
from breakgraph.base.command_line import write_problem


@bg.eager_on_graph
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Runs eagerly between graph segments, as attention with dynamic metadata must."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.RMSNorm(dim)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, seq, 3, self.heads, dim // self.heads).unbind(2)
        y = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + self.proj(y.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyTransformer(nn.Module):
    def __init__(self, dim: int = 256, heads: int = 4, layers: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _time_ms(variants: dict, iters: int, synchronize) -> dict:
    """Median ms per call of each variant, timed the same way and interleaved (a, b, a, b, …)
    so that the machine's drift falls on every variant alike."""
    for step in variants.values():  # one untimed call each: first-call costs are nobody's
        step()
    samples = {name: [] for name in variants}
    for _ in range(iters):
        for name, step in variants.items():
            synchronize()
            start = time.perf_counter()
            step()
            synchronize()
            samples[name].append((time.perf_counter() - start) * 1000)
    return {name: statistics.median(values) for name, values in samples.items()}


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive whole number, got {text!r}")
    return value


_DEFAULT_PLOT = "breakgraph_profile.png"  # checked only where a plot is written: a run without a GPU writes none


def _plot_path(text: str) -> str:
    """Refuse at once a plot path that the run could only fail to write at its end."""
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a folder; give --plot a file in it, e.g. {Path(text) / 'breakgraph_profile.png'}")
    problem = write_problem(Path(text).parent)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"cannot write {text}: {problem}; give --plot a path in a folder you can write")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=_positive, default=8, metavar="N", help="sequences per step (default 8)")
    parser.add_argument("--seq", type=_positive, default=32, metavar="N", help="tokens per sequence (default 32)")
    parser.add_argument("--iters", type=_positive, default=50, metavar="N", help="timed steps per variant (default 50)")
    parser.add_argument(
        "--plot",
        type=_plot_path,
        metavar="PATH",
        help=f"where to write the per-segment profile plot (GPU only; default {_DEFAULT_PLOT})",
    )


def run(args: argparse.Namespace) -> int:
    """Capture the model (or, without a GPU, run its eager path), check it, time it, report."""
    torch.manual_seed(0)
    eager_reason = runtime.eager_fallback_reason()
    on_gpu = eager_reason is None
    device = "cuda" if on_gpu else "cpu"
    if not on_gpu:
        print(f"breakgraph demo: {eager_reason}; running the eager path (the same model code, no graphs)")
    plot = args.plot
    if on_gpu and plot is None:
        try:
            plot = _plot_path(_DEFAULT_PLOT)
        except argparse.ArgumentTypeError as refused:
            print(f"breakgraph demo: the profile plot's default path: {refused}", file=sys.stderr)
            return 2
    model = TinyTransformer().to(device).eval()
    static_x = torch.randn(args.batch, args.seq, 256, device=device)

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the no-GPU warning is printed above already
        step = bg.graphed(model, static_x)
        worst = 0.0
        for trial in range(3):  # fresh inputs every time: replay must track them
            fresh = torch.randn_like(static_x)
            static_x.copy_(fresh)
            expected = model(fresh)
            out = step.replay()
            assert out is step.output, "replay must return the one output object"
            worst = max(worst, (out - expected).abs().max().item())
        sync = torch.cuda.synchronize if on_gpu else (lambda: None)
        timed = _time_ms({"eager": lambda: model(static_x), "replay": step.replay}, args.iters, sync)
        eager_ms, replay_ms = timed["eager"], timed["replay"]

    print(f"model: TinyTransformer, 4 blocks, batch {args.batch} x seq {args.seq} x dim 256, device {device}")
    verdict = "OK" if worst < 1e-3 else "MISMATCH"
    if on_gpu:
        print(f"replay vs eager on 3 fresh inputs: max abs difference {worst:.2e} ({verdict})")
        graph = step.graph
        print(f"captured: {graph.num_graphs} graph segments, {graph.num_eager_breaks} eager breaks")
        diagnostics.summary(graph)
        rows = diagnostics.profile(graph, iters=20)
        print(diagnostics.format_profile(rows))
        Path(plot).parent.mkdir(parents=True, exist_ok=True)  # checked before the run
        print(f"profile plot: {diagnostics.plot_profile(rows, plot)}")
        print(f"time per step: eager {eager_ms:.3f} ms, breakable replay {replay_ms:.3f} ms ({eager_ms / replay_ms:.2f}x)")
    else:
        print(
            f"checked: the callable form's output, refreshed in place on 3 fresh inputs, against a plain model "
            f"call: max abs difference {worst:.2e} ({verdict}). Not checked: graph capture and replay, which "
            "need a GPU; nothing was captured, and no profile plot was written."
        )
        print(
            f"time per step (medians of {args.iters}, interleaved): plain model call {eager_ms:.3f} ms, callable "
            f"form's eager path {replay_ms:.3f} ms (the same call, plus copying the result into its one output "
            "object). On a CPU this only shows what the fallback costs: breakgraph's speed-up comes from CUDA "
            "graphs, which need a GPU."
        )
    return 0 if worst < 1e-3 else 1
