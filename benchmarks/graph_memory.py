"""Graph memory an engine can plan around: executables, sharing, the estimate, release and restore.

For the benchmark decoder at 35 batch sizes (1, 2, 4, 8, 16, 24, …, 256) and
for a second shape (hidden 4096, 8 layers), side by side in one run:

- **estimate vs measured**: ``GraphRunner.estimate_memory()`` (five probe
  sizes) against what the 35 graphs hold once captured (``runner.memory()``:
  the pool, and the executables measured with ``cudaMemGetInfo`` around each
  instantiation), and against the device memory the whole capture took
  (``cudaMemGetInfo`` before and after); each model in a fresh process;
- **executables**: their bytes and instantiation time, with one executable
  per segment per size and with executables shared across sizes
  (``share_executables=True``), the refusals, and the switch cost per replay;
- **release / restore**: bytes freed and seconds, for executables only
  (``keep_graphs=True``) and for everything, with ``cudaDeviceGraphMemTrim``
  after the first; every restore's replays compared bit for bit with before.

    python3 -m benchmarks.graph_memory [--quick] [--out results]
"""

from __future__ import annotations

import multiprocessing
import time

import torch

import breakgraph as bg
import breakgraph_bindings as bindings

from breakgraph.base.pool import PoolUsage

from benchmarks.common import benchmark_parser, device_meta, require_gpu, time_variants, write_outputs
from benchmarks.attention import attention_break
from benchmarks.decoder import Decoder, DecoderConfig
from benchmarks.decoder_sizes import BatchInputs, check_sizes, runner_replay

LENGTH = 1015
MIB = 2**20


def free_after_sync() -> int:
    torch.cuda.synchronize()
    return bindings.free_device_memory()


def bit_identical(before: dict, after: dict) -> bool:
    return all(torch.equal(before[size], after[size]) for size in before)


def largest_difference(before: dict, after: dict) -> float:
    return max(float((before[size].float() - after[size].float()).abs().max()) for size in before)


def measure_model(name: str, config: DecoderConfig, sizes: list[int]) -> tuple[list[dict], dict]:
    """One model's rows and facts: its steps in turn, the runner that owns its executables
    kept beside the shared one, so that a switch between sizes costs each its own way."""
    model = ModelMeasurement(name, config, sizes)
    runner, measured = model.capture_own()
    reference = model.release_executables(runner, measured)
    model.release_everything(runner, measured, reference)
    shared, shared_memory, sharing = model.capture_shared()
    switching = model.switch_cost(runner, shared)
    model.release_shared(shared, shared_memory)
    model.facts.update(
        sharing, executables_own=measured["executable_bytes"], executables_shared=shared_memory["executable_bytes"], **switching
    )
    del runner, shared
    return model.rows, model.facts


class ModelMeasurement:
    """The decoder of ``config`` at ``sizes``, warm, and the rows and facts its steps fill in."""

    def __init__(self, name: str, config: DecoderConfig, sizes: list[int]):
        self.name, self.sizes = name, sizes
        self.inputs = BatchInputs(Decoder(config, max_batch=max(sizes)), max(sizes), LENGTH)
        self.inputs.warm_up(sizes, torch.cuda.Stream())
        self.rows, self.facts = [], {"sizes": len(sizes)}

    def make_runner(self, **options) -> bg.GraphRunner:
        """A runner at every size that measures its executables (``memory()`` counts them)."""
        inputs = self.inputs
        return bg.GraphRunner(
            inputs.step_fn(attention_break), (inputs.x, inputs.positions), self.sizes, progress=False, measure_memory=True, **options
        )

    def outputs(self, runner: bg.GraphRunner) -> dict:
        """The runner's output at each size on fixed inputs, cloned."""
        x, positions = self.inputs.x, self.inputs.positions
        return {size: runner(x[:size].clone(), positions[:size].clone()).clone() for size in self.sizes}

    def row(self, variant, pool=None, executables=None, total=None, seconds=None, note=""):
        mib = lambda value: "" if value is None else round(value / MIB, 1)  # noqa: E731
        self.rows.append(
            {
                "model": self.name,
                "variant": variant,
                "pool_mib": mib(pool),
                "executable_mib": mib(executables),
                "total_mib": mib(total),
                "seconds": "" if seconds is None else round(seconds, 3),
                "note": note,
            }
        )

    def capture_checked(self, runner: bg.GraphRunner, free_before: int) -> tuple[float, int, float]:
        """Capture every size: the seconds it took, the device memory taken since ``free_before``
        (``cudaMemGetInfo``), and the largest difference of its replays from eager."""
        started = time.perf_counter()
        runner.capture()
        seconds = time.perf_counter() - started
        taken = free_before - free_after_sync()
        return seconds, taken, check_sizes(self.inputs, runner_replay(self.inputs, runner), self.sizes)

    def capture_own(self) -> tuple[bg.GraphRunner, dict]:
        """One executable per segment per size: the estimate first, then the rest of the sizes;
        the runner and its ``memory()``."""
        sizes = self.sizes
        free_start = free_after_sync()
        runner = self.make_runner()
        estimate = runner.estimate_memory()
        capture_s, device_taken, worst = self.capture_checked(runner, free_start)
        measured = runner.memory()
        error = estimate.total_bytes / measured["total_bytes"] - 1
        self.row("estimate_memory(), 5 probes", estimate.pool_bytes, estimate.executable_bytes, estimate.total_bytes,
                 estimate.seconds, f"{error:+.1%} vs measured; probes {list(estimate.probed_sizes)}")
        self.row("measured: breakgraph runner.memory()", measured["pool_bytes"], measured["executable_bytes"], measured["total_bytes"],
                 capture_s + estimate.seconds, f"{len(sizes)} sizes captured; max abs diff vs eager {worst:.3g}")
        self.row("measured: cudaMemGetInfo around the capture", total=device_taken, note="pool + executables + anything else")
        final = PoolUsage.of(runner.pool)
        self.facts.update(
            estimate_error=round(error, 4),
            max_abs_diff=worst,
            estimate={"pool": estimate.pool_bytes, "executables": estimate.executable_bytes,
                      "allocated_after_probes": estimate.pool_allocated_after_probes,
                      "probes": [vars(probe) for probe in estimate.probes]},
            measured={"pool": final.reserved_bytes, "allocated": final.allocated_bytes,
                      "executables": measured["executable_bytes"],
                      "nodes_by_size": {size: sum(s.num_nodes for s in runner.graphs[(None, size)].segments) for size in sizes},
                      "executable_bytes_by_size": {size: runner.graphs[(None, size)].executable_bytes for size in sizes}},
        )
        return runner, measured

    def release_executables(self, runner: bg.GraphRunner, measured: dict) -> dict:
        """Executables only: release (the driver's memory), trim, restore (instantiation time).
        Returns the replays' outputs before, which every later restore is held to."""
        reference = self.outputs(runner)
        again = self.outputs(runner)  # how alike two rounds of replays are, nothing released
        self.facts.update(replays_bit_identical=bit_identical(reference, again), replays_differ_by=largest_difference(reference, again))
        released = runner.release(keep_graphs=True)
        free_released = free_after_sync()
        bindings.trim_graph_memory(torch.cuda.current_device())
        trimmed = free_after_sync() - free_released
        restored = runner.restore()
        after = self.outputs(runner)
        same = bit_identical(reference, after)
        self.facts.update(keep_graphs_differ_by=largest_difference(reference, after))
        self.row("release(keep_graphs=True)", executables=released["freed_bytes"], seconds=released["seconds"],
                 note=f"executables measured at instantiation: {measured['executable_bytes'] / MIB:.1f} MiB; "
                 f"cudaDeviceGraphMemTrim then freed {trimmed / MIB:.1f} MiB")
        self.row("restore(): instantiate again", executables=restored["taken_bytes"], seconds=restored["seconds"],
                 note=f"replays bit-identical to before: {same} (differ by {self.facts['keep_graphs_differ_by']:.3g}; "
                 f"two rounds of replays, nothing released, differ by {self.facts['replays_differ_by']:.3g})")
        self.facts.update(executables_freed=released["freed_bytes"], trim_freed=trimmed, keep_graphs_bit_identical=same)
        return reference

    def release_everything(self, runner: bg.GraphRunner, measured: dict, reference: dict) -> None:
        """Everything: release the pool and the executables, restore by capturing again."""
        released = runner.release(keep_graphs=False)
        restored = runner.restore()
        after = self.outputs(runner)
        same = bit_identical(reference, after)
        self.facts.update(everything_differs_by=largest_difference(reference, after))
        share = released["freed_bytes"] / max(1, measured["total_bytes"])
        self.row("release(): everything", total=released["freed_bytes"], seconds=released["seconds"],
                 note=f"{share:.0%} of what the graphs held ({released['freed_bytes'] / max(1, measured['pool_bytes']):.0%} of the pool)")
        self.row("restore(): capture again", total=restored["taken_bytes"], seconds=restored["seconds"],
                 note=f"replays bit-identical to before: {same} (differ by {self.facts['everything_differs_by']:.3g})")
        self.facts.update(release_all_share=round(share, 3), release_all_bit_identical=same)

    def capture_shared(self) -> tuple[bg.GraphRunner, dict, dict]:
        """Executables shared across sizes: the runner, its ``memory()``, and what it shared and refused."""
        shared = self.make_runner(share_executables=True)
        shared_capture_s, shared_taken, worst_shared = self.capture_checked(shared, free_after_sync())
        shared_memory = shared.memory()
        refusals = [refusal for refused in shared.refusals.values() for refusal in refused]
        reasons = sorted({reason for refusal in refusals for reason in refusal.reasons})
        graph_segments = [s for graph in shared.graphs.values() for s in graph.segments if s.kind == "graph"]
        executables = sum(1 for s in graph_segments if s.executable is not None)
        self.row("share_executables=True", shared_memory["pool_bytes"], shared_memory["executable_bytes"],
                 shared_memory["total_bytes"], shared_capture_s,
                 f"{executables} executables for {len(graph_segments)} graph segments; {len(refusals)} segments refused "
                 f"{reasons}; cudaMemGetInfo around the capture {shared_taken / MIB:.1f} MiB; max abs diff {worst_shared:.3g}")
        sharing = {"refusals": len(refusals), "executables_kept": executables, "graph_segments": len(graph_segments), "refusal_reasons": reasons}
        return shared, shared_memory, sharing

    def switch_cost(self, runner: bg.GraphRunner, shared: bg.GraphRunner) -> dict:
        """What a change of size costs a replay with shared executables. Switching sizes costs
        nothing without sharing: ``runner``, which owns its executables, is the baseline."""
        x, positions = self.inputs.x, self.inputs.positions
        small, large = self.sizes[1], self.sizes[-1]
        alternating = lambda r: (lambda: (r(x[:small], positions[:small]), r(x[:large], positions[:large])))  # noqa: E731
        same_sizes = lambda r: (lambda: (r(x[:large], positions[:large]), r(x[:large], positions[:large])))  # noqa: E731
        timings = time_variants(
            {
                "own, alternating": alternating(runner),
                "own, same size": same_sizes(runner),
                "shared, alternating": alternating(shared),
                "shared, same size": same_sizes(shared),
            },
            iters=20,
        )
        # Each alternating pair switches twice; the same-size pair replays the large size twice.
        switch_us = ((timings["shared, alternating"] - timings["own, alternating"]) / 2)
        segments = sum(1 for segment in shared.graphs[(None, large)].segments if segment.kind == "graph")
        self.row("switch cost per replay (shared)", seconds=switch_us / 1e6,
                 note=f"{switch_us:.0f} µs per size change, {switch_us / segments:.1f} µs per segment "
                 f"(pairs of replays: own {timings['own, alternating']:.0f} µs alternating, shared "
                 f"{timings['shared, alternating']:.0f} µs alternating, {timings['shared, same size']:.0f} µs same size)")
        return {"switch_us": round(switch_us, 1), "pair_timings_us": {k: round(v, 1) for k, v in timings.items()}}

    def release_shared(self, shared: bg.GraphRunner, shared_memory: dict) -> None:
        """Release and restore with shared executables: executables only, then everything."""
        released = shared.release(keep_graphs=True)
        restored = shared.restore()  # instantiates every segment again, then shares
        self.row("restore(), shared executables: instantiate and share", executables=restored["taken_bytes"],
                 seconds=restored["seconds"], note="compare restore(): instantiate again above (no sharing)")
        shared_reference = self.outputs(shared)
        released = shared.release(keep_graphs=False)
        restored = shared.restore()
        shared_after = self.outputs(shared)
        shared_share = released["freed_bytes"] / max(1, shared_memory["total_bytes"])
        self.row("release(): everything, shared executables", total=released["freed_bytes"], seconds=released["seconds"],
                 note=f"{shared_share:.0%} of what the graphs held; restore (capture again) {restored['seconds']:.2f} s, "
                 f"replays differ from before by {largest_difference(shared_reference, shared_after):.3g}")
        self.facts.update(release_all_shared_share=round(shared_share, 3))


def main(argv=None) -> int:
    parser = benchmark_parser("graph_memory", __doc__)
    parser.add_argument("--quick", action="store_true", help="2-layer models at sizes up to 32")
    args = parser.parse_args(argv)
    require_gpu("graph_memory")
    sizes = bg.default_capture_sizes(32 if args.quick else 256)
    models = {
        "decoder 16x2048": DecoderConfig(layers=2 if args.quick else 16),
        "decoder 8x4096": DecoderConfig(layers=2 if args.quick else 8, hidden=4096, heads=32, kv_heads=8, intermediate=11008),
    }
    rows, facts = [], {}
    # Each model in a fresh process, as an engine captures one: the driver keeps the memory of
    # destroyed executables for later ones, so a second model in one process would reuse it.
    spawn = multiprocessing.get_context("spawn")
    for name, config in models.items():
        with spawn.Pool(1) as worker:
            model_rows, facts[name] = worker.apply(measure_model, (name, config, sizes))
        rows += model_rows
    for name, fact in facts.items():
        print(f"{name}: {fact}")
    summary = {
        "model": "all",
        "variant": "ratios",
        "note": "; ".join(f"{name}: estimate {fact['estimate_error']:+.1%}" for name, fact in facts.items()),
    }
    columns = ["model", "variant", "pool_mib", "executable_mib", "total_mib", "seconds", "note"]
    write_outputs("graph_memory", rows + [summary], columns, args.out, device_meta() | {"models": facts}, draw)
    return 0


def draw(ax, rows):
    picked = [r for r in rows if r["total_mib"] != "" and not r["variant"].startswith("restore")]
    labels = [f"{r['model']}\n{r['variant']}" for r in picked]
    ax.barh(range(len(picked)), [r["total_mib"] for r in picked])
    ax.set_yticks(range(len(picked)), labels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("MiB")
    ax.set_title(f"Graph memory at 35 sizes: estimate, measured, released ({torch.cuda.get_device_name()})")


if __name__ == "__main__":
    raise SystemExit(main())
