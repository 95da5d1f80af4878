"""Training-step latency with dropout captured inside the graphs.

One step of an MLP with dropout after every layer: forward, an eager break
that reads the loss on the host (as a training loop logs it), backward, an
eager break that clips the gradient norm on the host's say, and the
optimizer step. Variants, side by side in one run: eager; breakgraph (one
capture, dropout inside its segments); one torch.cuda.CUDAGraph per segment
with the breaks replayed in a Python loop (the peers' way, dropout inside
torch's graphs); Meta's library (breakable_cuda_graphs, the ``bench``
extra; skipped with the reason printed where it is not installed): the same
step in one ``breakable_graph``, both breaks ``@no_graph`` functions; and a
monolithic torch.cuda.graph of the step with the breaks left out (less
work: the lower bound). Before timing, every variant
runs seeded steps from the same weights and is compared with eager under
the same seeds: the same generator offsets draw the same dropout masks.

    python -m benchmarks.training_step [--quick] [--out results]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import breakgraph as bg
from benchmarks.common import benchmark_parser, device_meta, plot_grouped_bars, require_gpu, synchronized, time_alternated, write_outputs
from benchmarks.peers import META, load_meta, meta_ratios
from breakgraph.base.runtime import run_on_stream

VARIANTS = ("eager", "breakgraph", "torch CUDAGraph per segment", "lower bound: monolithic graph, no breaks")


class Trainer:
    """Model, optimizer and static batch; ``step(log, clip)`` is one training step."""

    def __init__(self, hidden: int, layers: int, batch: int, dropout: float):
        torch.manual_seed(0)
        blocks = []
        for _ in range(layers):
            blocks += [nn.Linear(hidden, hidden), nn.GELU(), nn.Dropout(dropout)]
        self.model = nn.Sequential(*blocks, nn.Linear(hidden, 1)).cuda()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.x = torch.randn(batch, hidden, device="cuda")
        self.y = torch.randn(batch, 1, device="cuda")
        self.logged = torch.zeros((), device="cuda")

    def forward(self):
        self.opt.zero_grad(set_to_none=False)
        return F.mse_loss(self.model(self.x), self.y)

    def backward(self, loss):
        loss.backward()

    def update(self):
        self.opt.step()

    def step(self, log, clip):
        loss = self.forward()
        log(loss)
        self.backward(loss)
        clip(self.model)
        self.update()
        return loss


def log_loss(loss):
    """A host read of the loss: what a training loop prints."""
    return float(loss.item())


CLIP_NORM = 0.01
"""The gradient norm the clip keeps: far below the gradients' own, so every step is clipped and a
variant that skipped the clip would fail the check against eager."""

ROUNDS = 2000
"""Rounds of single steps, each round one step of every variant in a shuffled order
(``time_alternated``): a variant's median step is over ``ROUNDS`` steps."""


TOLERANCE = 1e-4
"""How far a variant's losses, weights and gradients may lie from eager's (they are equal in practice)."""


def clip_gradients(model):
    """Gradient-norm clipping decided on the host (``error_if_nonfinite`` reads the norm back)."""
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM, error_if_nonfinite=True)


class Captured:
    """Every variant's capture of one trainer's step (Meta's library's where ``meta_library``
    is the module, not None)."""

    def __init__(self, trainer: Trainer, stream: torch.cuda.Stream, meta_library):
        self.trainer = trainer
        run_on_stream(stream, lambda: trainer.step(log_loss, clip_gradients))  # warm up: grads exist
        self.state = {k: v.clone() for k, v in trainer.model.state_dict().items()}

        self.graph = bg.BreakableCUDAGraph()
        with bg.BreakableCUDAGraphCapture(self.graph, stream=stream):
            self.loss_bg = trainer.step(bg.eager_on_graph(log_loss), bg.eager_on_graph(clip_gradients))

        pool = torch.cuda.graph_pool_handle()
        self.segments = [torch.cuda.CUDAGraph() for _ in range(3)]

        def per_segment():
            self.segments[0].capture_begin(pool=pool)
            loss = trainer.forward()
            self.segments[0].capture_end()
            log_loss(loss)
            self.segments[1].capture_begin(pool=pool)
            trainer.backward(loss)
            self.segments[1].capture_end()
            clip_gradients(trainer.model)
            self.segments[2].capture_begin(pool=pool)
            trainer.update()
            self.segments[2].capture_end()
            return loss

        self.loss_seg = run_on_stream(stream, per_segment)

        self.monolithic = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.monolithic, stream=stream, pool=pool):
            self.loss_mono = trainer.step(lambda loss: None, lambda model: None)

        # Meta's library needs nothing of its own for training: each segment is a torch.cuda.graph,
        # which draws dropout's numbers as the per-segment graphs do, and both breaks may be
        # @no_graph functions as they are (the loss's host read returns a float, not a CUDA
        # tensor). Its replay drops what a break returns, as the per-segment loop does.
        self.meta_graph = None
        if meta_library is not None:
            self.meta_graph = meta_library.BreakableCUDAGraph()
            with meta_library.breakable_graph(self.meta_graph, stream=stream):
                self.loss_meta = trainer.step(meta_library.no_graph(log_loss), meta_library.no_graph(clip_gradients))
        trainer.model.load_state_dict(self.state)

    def runs(self) -> dict:
        trainer = self.trainer

        def per_segment():
            self.segments[0].replay()
            log_loss(self.loss_seg)
            self.segments[1].replay()
            clip_gradients(trainer.model)
            self.segments[2].replay()
            return self.loss_seg

        runs = {
            VARIANTS[0]: lambda: trainer.step(log_loss, clip_gradients),
            VARIANTS[1]: lambda: (self.graph.replay(), self.loss_bg)[1],
            VARIANTS[2]: per_segment,
            VARIANTS[3]: lambda: (self.monolithic.replay(), self.loss_mono)[1],
        }
        if self.meta_graph is not None:
            runs[META] = lambda: (self.meta_graph.replay(), self.loss_meta)[1]
        return runs

    def check(self, steps: int = 3) -> dict:
        """From the same weights and seeds, every variant's losses, weights and last gradients
        against eager's. The gradients are clipped in every step (``CLIP_NORM``), so the lower
        bound, which leaves the clip out, must differ: the check would catch a variant that did."""
        results = {}
        for name, run in self.runs().items():
            self.trainer.model.load_state_dict(self.state)
            losses = []
            for seed in range(steps):
                torch.cuda.manual_seed(seed)
                losses.append(run().clone())
            parameters = list(self.trainer.model.parameters())
            results[name] = (torch.stack(losses), [p.detach().clone() for p in parameters] + [p.grad.clone() for p in parameters])
        eager_losses, eager_tensors = results[VARIANTS[0]]
        eager_grads = eager_tensors[len(eager_tensors) // 2 :]
        clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in eager_grads])).item()
        assert abs(clipped - CLIP_NORM) < 1e-3 * CLIP_NORM, f"the gradients' norm {clipped} was not clipped to {CLIP_NORM}"
        differences = {}
        for name, (losses, tensors) in results.items():
            difference = (losses - eager_losses).abs().max().item()
            difference = max([difference] + [(t - e).abs().max().item() for t, e in zip(tensors, eager_tensors)])
            if name != VARIANTS[3]:
                assert difference < TOLERANCE, f"{name}: differs from eager by {difference}"
            differences[name] = difference
        lower_bound = differences[VARIANTS[3]]
        assert lower_bound > 10 * TOLERANCE, f"leaving the clip out changed the step by only {lower_bound}: the check cannot see it"
        self.trainer.model.load_state_dict(self.state)
        return differences


def main(argv=None) -> int:
    parser = benchmark_parser("training_step", __doc__)
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    args = parser.parse_args(argv)
    require_gpu("training_step")
    rounds = 20 if args.quick else ROUNDS
    shapes = [(512, 4, 32)] if args.quick else [(512, 8, 32), (1024, 8, 256), (2048, 8, 1024)]
    stream = torch.cuda.Stream()
    meta_library = load_meta()
    rows = []
    for hidden, layers, batch in shapes:
        captured = Captured(Trainer(hidden, layers, batch, dropout=0.1), stream, meta_library)
        differences = captured.check()
        assert captured.graph.draws_random_numbers and captured.graph.num_eager_breaks == 2
        us = time_alternated({name: synchronized(run) for name, run in captured.runs().items()}, rounds)
        label = f"{hidden}x{layers}, batch {batch}"
        for name, value in us.items():
            rows.append(
                {
                    "shape": label,
                    "variant": name,
                    "step_us": round(value, 1),
                    "max_abs_diff_vs_eager": f"{differences[name]:.1e}",
                }
            )
        ours = us[VARIANTS[1]]
        ratios = (
            f"torch-per-segment/breakgraph {us[VARIANTS[2]] / ours:.2f}x; "
            f"eager/breakgraph {us[VARIANTS[0]] / ours:.2f}x; breakgraph/lower bound {ours / us[VARIANTS[3]]:.2f}x"
        )
        ratios += meta_ratios(us, {"breakgraph": ours})
        rows.append({"shape": label, "variant": "ratios", "step_us": ratios})
        del captured
    write_outputs("training_step", rows, ["shape", "variant", "step_us", "max_abs_diff_vs_eager"], args.out, device_meta(), draw)
    return 0


def draw(ax, rows):
    plot_grouped_bars(ax, rows, "shape", "step_us", str)
    ax.set_yscale("log")
    ax.set_ylabel("training step (µs, lower is better)")
    ax.set_title(f"Training step with dropout ({torch.cuda.get_device_name()})")


if __name__ == "__main__":
    raise SystemExit(main())
