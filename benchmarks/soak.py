"""Soak: an engine's life in one process, measured for drift.

A GraphRunner over the benchmark decoder, captured at 35 batch sizes (1, 2,
4, 8, 16, 24, …, 256), serves random live batch sizes for 100,000 steps.
Every 250 steps a second graph (its own pool) is captured, replayed,
checked and then reset or dropped, as an engine recaptures beside the
graphs it serves, so the process makes hundreds of pools. Every 1,000 steps
one live batch is checked against eager (max abs difference); every 5,000
steps (a fifth of the run, if shorter) the script samples steps per second,
reserved memory, reserved memory after ``torch.cuda.empty_cache()`` (what
the process holds and cannot give back) and the runner's pool bytes. All
three must stay flat.

A graph dropped while its output is still referenced (as the second graph
is, every other cycle) keeps that output's memory until the output goes;
breakgraph gives it back at the next drop or capture, so reserved memory
does not wait for ``empty_cache()`` to come back.

    python -m benchmarks.soak [--quick] [--steps N] [--out results]
"""

from __future__ import annotations

import random
import time

import torch

import breakgraph as bg

from benchmarks.common import benchmark_parser, device_meta, require_gpu, write_outputs
from benchmarks.attention import attention_break
from benchmarks.decoder import Decoder, DecoderConfig, assert_matches_eager
from benchmarks.decoder_sizes import BatchInputs

LENGTH = 1015
SAMPLE_EVERY, CHECK_EVERY, RECAPTURE_EVERY = 5_000, 1_000, 250
FLAT_MIB = 64  # reserved memory may move this much across the run and still count as flat


class SecondGraph:
    """A graph beside the runner's, captured and checked, then reset or dropped in turn."""

    def __init__(self, inputs: BatchInputs, size: int = 4):
        self.inputs, self.size = inputs, size
        self.x = inputs.x[:size].clone()
        self.positions = inputs.positions[:size].clone()
        self.graph: bg.BreakableCUDAGraph | None = None
        self.cycles = 0

    def cycle(self) -> float:
        """Capture, replay on fresh input, compare with eager; reset or drop the graph. Returns
        the max abs difference against eager."""
        if self.graph is None:
            self.graph = bg.BreakableCUDAGraph()
        decoder, meta = self.inputs.decoder, self.inputs.meta
        with bg.BreakableCUDAGraphCapture(self.graph):
            out = decoder.step(self.x, self.positions, meta, attention_break)
        self.x.copy_(torch.randn_like(self.x))
        expected = decoder.step(self.x, self.positions, meta)
        out.fill_(float("nan"))
        self.graph.replay()
        difference = assert_matches_eager(out, expected, f"second graph, cycle {self.cycles}")
        self.cycles += 1
        if self.cycles % 2:
            self.graph.reset()
        else:
            self.graph = None  # dropped with its pool: the next cycle makes a new one
        return difference


def soak(steps: int, config: DecoderConfig, seed: int = 0) -> tuple[list[dict], list[dict], dict]:
    sample_every = min(SAMPLE_EVERY, max(1, steps // 5))
    sizes = bg.default_capture_sizes(256)
    decoder = Decoder(config, max_batch=max(sizes))
    inputs = BatchInputs(decoder, max(sizes), LENGTH)
    stream = torch.cuda.Stream()
    inputs.warm_up([1, 4, 8, 64, 256], stream)  # 4: the second graph's size
    started = time.perf_counter()
    runner = bg.GraphRunner(inputs.step_fn(attention_break), (inputs.x, inputs.positions), sizes, progress=False).capture()
    capture_s = time.perf_counter() - started
    second = SecondGraph(inputs)
    pick = random.Random(seed)
    live_x = torch.randn_like(inputs.x)
    live_positions = inputs.positions.clone()
    samples, checks = [], []
    window_diff, window_started = 0.0, time.perf_counter()
    for step in range(1, steps + 1):
        n = pick.randint(1, max(sizes))
        if step % CHECK_EVERY == 0:
            live_x[:n].normal_()
            out = runner(live_x[:n], live_positions[:n])
            expected = decoder.step(live_x[:n], live_positions[:n], inputs.meta)
            difference = assert_matches_eager(out, expected, f"step {step}, batch {n}")
            checks.append({"step": step, "batch": n, "max_abs_diff": difference})
            window_diff = max(window_diff, difference)
        else:
            runner(live_x[:n], live_positions[:n])
        if step % RECAPTURE_EVERY == 0:
            window_diff = max(window_diff, second.cycle())
        if step % sample_every == 0 or step == steps:
            torch.cuda.synchronize()
            now = time.perf_counter()
            reserved = torch.cuda.memory_reserved()
            torch.cuda.empty_cache()
            samples.append(
                {
                    "variant": "breakgraph GraphRunner, 35 sizes",
                    "step": step,
                    "steps_per_s": round((step - (samples[-1]["step"] if samples else 0)) / (now - window_started), 1),
                    "reserved_mib": round(reserved / 2**20, 1),
                    "held_mib": round(torch.cuda.memory_reserved() / 2**20, 1),
                    "pool_mib": round(bg.pool_bytes(runner.pool) / 2**20, 1),
                    "max_abs_diff": round(window_diff, 5),
                }
            )
            print(f"step {step}: {samples[-1]}", flush=True)
            window_diff, window_started = 0.0, time.perf_counter()
    facts = {"capture_s": round(capture_s, 2), "second_graph_cycles": second.cycles, "sizes": sizes}
    return samples, checks, facts


def main(argv=None) -> int:
    parser = benchmark_parser("soak", __doc__)
    parser.add_argument("--quick", action="store_true", help="5,000 steps of a 2-layer decoder")
    parser.add_argument("--steps", type=int, default=None, help="steps to run (default 100,000; 5,000 with --quick)")
    args = parser.parse_args(argv)
    require_gpu("soak")
    steps = args.steps or (5_000 if args.quick else 100_000)
    config = DecoderConfig(layers=2) if args.quick else DecoderConfig()
    samples, checks, facts = soak(steps, config)
    reserved = [row["reserved_mib"] for row in samples]
    held = [row["held_mib"] for row in samples]
    pool = [row["pool_mib"] for row in samples]
    serving = reserved[1:] or reserved  # the first sample still holds the warm-up's cache
    drift = {
        "reserved_drift_mib": round(max(serving) - min(serving), 1),
        "held_drift_mib": round(max(held) - min(held), 1),
        "pool_drift_mib": round(max(pool) - min(pool), 1),
        "flat": max(serving) - min(serving) <= FLAT_MIB and max(held) - min(held) <= FLAT_MIB and max(pool) == min(pool),
        "max_abs_diff_vs_eager": max(check["max_abs_diff"] for check in checks) if checks else None,
    }
    print(f"{steps} steps, {len(checks)} checks against eager, {facts['second_graph_cycles']} second-graph cycles; {drift}")
    meta = device_meta() | facts | drift | {"config": {k: str(v) for k, v in vars(config).items()}, "checks": checks}
    summary = {
        "variant": "ratios",
        "step": steps,
        "steps_per_s": f"35 sizes captured in {facts['capture_s']} s",
        "reserved_mib": f"drift {drift['reserved_drift_mib']}",
        "held_mib": f"drift {drift['held_drift_mib']}",
        "pool_mib": f"drift {drift['pool_drift_mib']}",
        "max_abs_diff": drift["max_abs_diff_vs_eager"],
    }
    columns = ["step", "variant", "steps_per_s", "reserved_mib", "held_mib", "pool_mib", "max_abs_diff"]
    rows = samples + [summary]
    write_outputs("soak", rows, columns, args.out, meta, draw)
    return 0


def draw(ax, rows):
    steps = [row["step"] for row in rows]
    ax.plot(steps, [row["reserved_mib"] for row in rows], marker="o", label="reserved MiB")
    ax.plot(steps, [row["held_mib"] for row in rows], marker="^", label="reserved after empty_cache() MiB")
    ax.plot(steps, [row["pool_mib"] for row in rows], marker="s", label="runner pool MiB")
    ax.set_xlabel("step")
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Soak: memory while serving random batch sizes ({torch.cuda.get_device_name()})")


if __name__ == "__main__":
    raise SystemExit(main())
