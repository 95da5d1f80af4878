"""Host decisions kept on the device: ``bg.cond`` and ``bg.while_loop`` against the breaks
every peer needs for the same decision.

**Skip-if-not-finite training step.** The training benchmark's MLP (no dropout):
forward, loss, backward, a gradient clip on the device and an SGD step, the step
skipped when the loss is not finite, the one host decision of the step. Variants,
side by side in one run: the guard as an eager break that reads the loss's
finiteness (``.item()``) and steps eagerly, as a breakable peer must write it;
the guard as ``bg.cond`` (no break); one ``torch.cuda.CUDAGraph`` for the forward
and backward and one for the update, the host reading the flag between them;
Meta's library (the ``bench`` extra) with the break form; and one
``torch.cuda.graph`` of the step with the guard left out (the bound). Before
timing, every variant runs steps from the same weights, one of them with a NaN
injected into the batch, and is compared with an eager guarded step: each
guarded variant skips that step, and the bound, which does not, must differ.

**K tokens per launch** (``benchmarks.token_loop``): greedy decoding, one launch
per token with the host checking the end token after each, against
``bg.while_loop`` decoding up to K tokens in one launch and stopping on the
device, on a host-bound model and on the GPU-bound decoder.

    python -m benchmarks.conditional [--quick] [--part guard|tokens|both] [--out results]
"""

from __future__ import annotations

import torch

import breakgraph as bg
from benchmarks.common import benchmark_parser, device_meta, plot_grouped_bars, require_gpu, synchronized, time_alternated, verdict, write_outputs
from benchmarks.peers import META, load_meta, meta_ratios
from benchmarks.token_loop import token_rows
from benchmarks.training_step import CLIP_NORM, Trainer
from breakgraph.base.runtime import run_on_stream

GUARDS = (
    "eager",
    "breakgraph, guard as bg.cond",
    "breakgraph, guard as a break (.item())",
    "torch CUDAGraph per segment",
    "bound: one graph, no guard",
)
COND_TARGET, BREAK_TARGET = 1.05, 1.3
ROUNDS = 2000
TOLERANCE = 1e-4


def clip_on_device(model) -> None:
    """Gradient-norm clipping with no host read."""
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM, foreach=True)


def forward_backward(trainer: Trainer) -> torch.Tensor:
    loss = trainer.forward()
    trainer.backward(loss)
    clip_on_device(trainer.model)
    return loss


def update_if_finite(trainer: Trainer, loss: torch.Tensor) -> None:
    """The guard as the host decides it: one read of the loss, then the step or not."""
    if bool(loss.isfinite()):
        trainer.update()


class GuardedStep:
    """Every variant's capture of one trainer's guarded step."""

    def __init__(self, trainer: Trainer, stream: torch.cuda.Stream, meta_library):
        self.trainer = t = trainer
        run_on_stream(stream, lambda: (update_if_finite(t, forward_backward(t)), torch.cuda.synchronize()))
        self.state = {k: v.clone() for k, v in t.model.state_dict().items()}

        self.with_cond = bg.BreakableCUDAGraph()
        with bg.BreakableCUDAGraphCapture(self.with_cond, stream=stream):
            self.loss_cond = forward_backward(t)
            bg.cond(self.loss_cond.isfinite(), t.update, lambda: None)
        assert self.with_cond.num_eager_breaks == 0 and self.with_cond.num_graphs == 1

        self.with_break = bg.BreakableCUDAGraph()
        with bg.BreakableCUDAGraphCapture(self.with_break, stream=stream):
            self.loss_break = forward_backward(t)
            bg.eager_on_graph(update_if_finite)(t, self.loss_break)

        pool = torch.cuda.graph_pool_handle()
        self.segments = [torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()]

        def per_segment():
            self.segments[0].capture_begin(pool=pool)
            loss = forward_backward(t)
            finite = loss.isfinite()
            self.segments[0].capture_end()
            self.segments[1].capture_begin(pool=pool)
            t.update()
            self.segments[1].capture_end()
            return loss, finite

        self.loss_seg, self.finite_seg = run_on_stream(stream, per_segment)

        self.bound = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.bound, stream=stream, pool=pool):
            self.loss_bound = forward_backward(t)
            t.update()

        self.meta_graph = None
        if meta_library is not None:
            self.meta_graph = meta_library.BreakableCUDAGraph()
            with meta_library.breakable_graph(self.meta_graph, stream=stream):
                self.loss_meta = forward_backward(t)
                meta_library.no_graph(update_if_finite)(t, self.loss_meta)
        t.model.load_state_dict(self.state)

    def runs(self) -> dict:
        t = self.trainer

        def per_segment():
            self.segments[0].replay()
            if self.finite_seg.item():
                self.segments[1].replay()
            return self.loss_seg

        def eager():
            loss = forward_backward(t)
            update_if_finite(t, loss)
            return loss

        runs = {
            GUARDS[0]: eager,
            GUARDS[1]: lambda: (self.with_cond.replay(), self.loss_cond)[1],
            GUARDS[2]: lambda: (self.with_break.replay(), self.loss_break)[1],
            GUARDS[3]: per_segment,
            GUARDS[4]: lambda: (self.bound.replay(), self.loss_bound)[1],
        }
        if self.meta_graph is not None:
            runs[META] = lambda: (self.meta_graph.replay(), self.loss_meta)[1]
        return runs

    def check(self, steps: int = 4, poisoned: int = 2) -> dict:
        """From the same weights, ``steps`` steps of every variant, step ``poisoned`` with a NaN
        in the batch, against eager: losses (NaN where eager's is) and weights. Every guarded
        variant skips the poisoned step; the bound, which has no guard, must differ."""
        x = self.trainer.x
        clean = x.clone()
        results = {}
        for name, run in self.runs().items():
            self.trainer.model.load_state_dict(self.state)
            losses = []
            for step in range(steps):
                x.copy_(clean + step * 0.01)
                if step == poisoned:
                    x[0, 0] = float("nan")
                losses.append(run().clone())
                torch.cuda.synchronize()
            results[name] = (torch.stack(losses), [p.detach().clone() for p in self.trainer.model.parameters()])
        x.copy_(clean)
        eager_losses, eager_weights = results[GUARDS[0]]
        assert not eager_losses[poisoned].isfinite() and all(w.isfinite().all() for w in eager_weights)
        differences = {}
        for name, (losses, weights) in results.items():
            same_nans = torch.equal(losses.isnan(), eager_losses.isnan())
            difference = max(
                [(losses - eager_losses).nan_to_num().abs().max().item()] + [(w - e).abs().max().item() for w, e in zip(weights, eager_weights)]
            )
            differences[name] = difference if same_nans else float("nan")
            if name != GUARDS[4]:
                assert same_nans and difference < TOLERANCE, f"{name}: differs from eager by {difference}"
        bound = differences[GUARDS[4]]
        assert not bound < 10 * TOLERANCE, "the unguarded step matched the guarded one: the check cannot see a step that does not skip"
        self.trainer.model.load_state_dict(self.state)
        return differences


def guard_rows(quick: bool, stream, meta_library) -> list[dict]:
    rows = []
    shapes = [(512, 4, 32)] if quick else [(512, 8, 32), (1024, 8, 256), (2048, 8, 1024)]
    for index, (hidden, layers, batch) in enumerate(shapes):
        step = GuardedStep(Trainer(hidden, layers, batch, dropout=0.0), stream, meta_library)
        differences = step.check()
        us = time_alternated({name: synchronized(run) for name, run in step.runs().items()}, 20 if quick else ROUNDS)
        label = f"{hidden}x{layers}, batch {batch}"
        for name, value in us.items():
            diff = differences[name]
            rows.append({"part": "guard", "shape": label, "variant": name, "us": round(value, 1), "check": "skips" if diff == diff else "does not skip"})
        ours = us[GUARDS[1]]
        over_bound, break_over = ours / us[GUARDS[4]], us[GUARDS[2]] / ours
        ratios = (
            f"cond/bound {over_bound:.3f}x (target <= {COND_TARGET}: {verdict(over_bound, COND_TARGET, True)}); "
            f"break/cond {break_over:.2f}x"
            + (f" (target >= {BREAK_TARGET} at the small shape: {verdict(break_over, BREAK_TARGET, False)})" if index == 0 else "")
            + f"; torch-per-segment/cond {us[GUARDS[3]] / ours:.2f}x; eager/cond {us[GUARDS[0]] / ours:.2f}x"
            + meta_ratios(us, {"cond": ours})
        )
        rows.append({"part": "guard", "shape": label, "variant": "ratios", "us": ratios})
        del step
    return rows


def main(argv=None) -> int:
    parser = benchmark_parser("conditional", __doc__)
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--part", choices=("guard", "tokens", "both"), default="both", help="which benchmark to run (default both)")
    args = parser.parse_args(argv)
    require_gpu("conditional")
    stream = torch.cuda.Stream()
    rows = []
    if args.part in ("guard", "both"):
        rows += guard_rows(args.quick, stream, load_meta())
    if args.part in ("tokens", "both"):
        rows += token_rows(args.quick)
    write_outputs("conditional", rows, ["part", "shape", "variant", "us", "check"], args.out, device_meta(), draw)
    return 0


def draw(ax, rows):
    plot_grouped_bars(ax, rows, "shape", "us", str)
    ax.set_yscale("log")
    ax.set_ylabel("µs per step or per token (lower is better)")
    ax.set_title(f"Decisions on the device ({torch.cuda.get_device_name()})")


if __name__ == "__main__":
    raise SystemExit(main())
