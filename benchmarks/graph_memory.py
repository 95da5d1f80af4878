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

from breakgraph.pool import PoolUsage

from benchmarks.common import benchmark_parser, device_meta, require_gpu, time_variants, write_outputs
from benchmarks.decoder import BatchInputs, Decoder, DecoderConfig, attention_break, check_sizes, runner_replay

LENGTH = 1015
MIB = 2**20


def free_after_sync() -> int:
    torch.cuda.synchronize()
    return bindings.free_device_memory()


def outputs_at(inputs: BatchInputs, runner: bg.GraphRunner, sizes) -> dict:
    """The runner's output at each of ``sizes`` on fixed inputs, cloned."""
    return {size: runner(inputs.x[:size].clone(), inputs.positions[:size].clone()).clone() for size in sizes}


def bit_identical(before: dict, after: dict) -> bool:
    return all(torch.equal(before[size], after[size]) for size in before)


def largest_difference(before: dict, after: dict) -> float:
    return max(float((before[size].float() - after[size].float()).abs().max()) for size in before)


def measure_model(name: str, config: DecoderConfig, sizes: list[int]) -> tuple[list[dict], dict]:
    decoder = Decoder(config, max_batch=max(sizes))
    inputs = BatchInputs(decoder, max(sizes), LENGTH)
    inputs.warm_up(sizes, torch.cuda.Stream())
    make = lambda **options: bg.GraphRunner(  # noqa: E731  (measured: memory() counts the executables)
        inputs.step_fn(attention_break), (inputs.x, inputs.positions), sizes, progress=False, measure_memory=True, **options
    )
    rows, facts = [], {"sizes": len(sizes)}

    def row(variant, pool=None, executables=None, total=None, seconds=None, note=""):
        mib = lambda value: "" if value is None else round(value / MIB, 1)  # noqa: E731
        rows.append(
            {
                "model": name,
                "variant": variant,
                "pool_mib": mib(pool),
                "executable_mib": mib(executables),
                "total_mib": mib(total),
                "seconds": "" if seconds is None else round(seconds, 3),
                "note": note,
            }
        )

    # One executable per segment per size: the estimate first, then the rest of the sizes.
    free_start = free_after_sync()
    runner = make()
    estimate = runner.estimate_memory()
    started = time.perf_counter()
    runner.capture()
    capture_s = time.perf_counter() - started
    device_taken = free_start - free_after_sync()
    worst = check_sizes(inputs, runner_replay(inputs, runner), sizes)
    measured = runner.memory()
    error = estimate.total_bytes / measured["total_bytes"] - 1
    row("estimate_memory(), 5 probes", estimate.pool_bytes, estimate.executable_bytes, estimate.total_bytes,
        estimate.seconds, f"{error:+.1%} vs measured; probes {list(estimate.probed_sizes)}")
    row("measured: breakgraph runner.memory()", measured["pool_bytes"], measured["executable_bytes"], measured["total_bytes"],
        capture_s + estimate.seconds, f"{len(sizes)} sizes captured; max abs diff vs eager {worst:.3g}")
    row("measured: cudaMemGetInfo around the capture", total=device_taken, note="pool + executables + anything else")
    final = PoolUsage.of(runner.pool)
    facts.update(
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

    # Executables only: release (the driver's memory), trim, restore (instantiation time).
    reference = outputs_at(inputs, runner, sizes)
    again = outputs_at(inputs, runner, sizes)  # how alike two rounds of replays are, nothing released
    facts.update(replays_bit_identical=bit_identical(reference, again), replays_differ_by=largest_difference(reference, again))
    released = runner.release(keep_graphs=True)
    free_released = free_after_sync()
    bindings.trim_graph_memory(torch.cuda.current_device())
    trimmed = free_after_sync() - free_released
    restored = runner.restore()
    after = outputs_at(inputs, runner, sizes)
    same = bit_identical(reference, after)
    facts.update(keep_graphs_differ_by=largest_difference(reference, after))
    row("release(keep_graphs=True)", executables=released["freed_bytes"], seconds=released["seconds"],
        note=f"executables measured at instantiation: {measured['executable_bytes'] / MIB:.1f} MiB; "
        f"cudaDeviceGraphMemTrim then freed {trimmed / MIB:.1f} MiB")
    row("restore(): instantiate again", executables=restored["taken_bytes"], seconds=restored["seconds"],
        note=f"replays bit-identical to before: {same} (differ by {facts['keep_graphs_differ_by']:.3g}; "
        f"two rounds of replays, nothing released, differ by {facts['replays_differ_by']:.3g})")
    facts.update(executables_freed=released["freed_bytes"], trim_freed=trimmed, keep_graphs_bit_identical=same)

    # Switching sizes costs nothing without sharing: the baseline for the shared runner below.
    small, large = sizes[1], sizes[-1]
    alternating = lambda r: (lambda: (r(inputs.x[:small], inputs.positions[:small]), r(inputs.x[:large], inputs.positions[:large])))  # noqa: E731
    same_sizes = lambda r: (lambda: (r(inputs.x[:large], inputs.positions[:large]), r(inputs.x[:large], inputs.positions[:large])))  # noqa: E731

    # Everything: release the pool and the executables, restore by capturing again.
    released = runner.release(keep_graphs=False)
    restored = runner.restore()
    after = outputs_at(inputs, runner, sizes)
    same = bit_identical(reference, after)
    facts.update(everything_differs_by=largest_difference(reference, after))
    share = released["freed_bytes"] / max(1, measured["total_bytes"])
    row("release(): everything", total=released["freed_bytes"], seconds=released["seconds"],
        note=f"{share:.0%} of what the graphs held ({released['freed_bytes'] / max(1, measured['pool_bytes']):.0%} of the pool)")
    row("restore(): capture again", total=restored["taken_bytes"], seconds=restored["seconds"],
        note=f"replays bit-identical to before: {same} (differ by {facts['everything_differs_by']:.3g})")
    facts.update(release_all_share=round(share, 3), release_all_bit_identical=same)

    # Executables shared across sizes.
    shared = make(share_executables=True)
    free_before = free_after_sync()
    started = time.perf_counter()
    shared.capture()
    shared_capture_s = time.perf_counter() - started
    shared_taken = free_before - free_after_sync()
    worst_shared = check_sizes(inputs, runner_replay(inputs, shared), sizes)
    shared_memory = shared.memory()
    refusals = [refusal for refused in shared.refusals.values() for refusal in refused]
    reasons = sorted({reason for refusal in refusals for reason in refusal.reasons})
    segments = sum(1 for segment in shared.graphs[(None, large)].segments if segment.kind == "graph")
    graph_segments = [s for graph in shared.graphs.values() for s in graph.segments if s.kind == "graph"]
    executables = sum(1 for s in graph_segments if s.executable is not None)
    row("share_executables=True", shared_memory["pool_bytes"], shared_memory["executable_bytes"],
        shared_memory["total_bytes"], shared_capture_s,
        f"{executables} executables for {len(graph_segments)} graph segments; {len(refusals)} segments refused "
        f"{reasons}; cudaMemGetInfo around the capture {shared_taken / MIB:.1f} MiB; max abs diff {worst_shared:.3g}")
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
    row("switch cost per replay (shared)", seconds=switch_us / 1e6,
        note=f"{switch_us:.0f} µs per size change, {switch_us / segments:.1f} µs per segment "
        f"(pairs of replays: own {timings['own, alternating']:.0f} µs alternating, shared "
        f"{timings['shared, alternating']:.0f} µs alternating, {timings['shared, same size']:.0f} µs same size)")
    released = shared.release(keep_graphs=True)
    restored = shared.restore()  # instantiates every segment again, then shares
    row("restore(), shared executables: instantiate and share", executables=restored["taken_bytes"],
        seconds=restored["seconds"], note="compare restore(): instantiate again above (no sharing)")
    shared_reference = outputs_at(inputs, shared, sizes)
    released = shared.release(keep_graphs=False)
    restored = shared.restore()
    shared_after = outputs_at(inputs, shared, sizes)
    shared_share = released["freed_bytes"] / max(1, shared_memory["total_bytes"])
    row("release(): everything, shared executables", total=released["freed_bytes"], seconds=released["seconds"],
        note=f"{shared_share:.0%} of what the graphs held; restore (capture again) {restored['seconds']:.2f} s, "
        f"replays differ from before by {largest_difference(shared_reference, shared_after):.3g}")
    facts.update(release_all_shared_share=round(shared_share, 3))
    facts.update(
        refusals=len(refusals),
        executables_kept=executables,
        graph_segments=len(graph_segments),
        refusal_reasons=reasons,
        executables_own=measured["executable_bytes"],
        executables_shared=shared_memory["executable_bytes"],
        switch_us=round(switch_us, 1),
        pair_timings_us={k: round(v, 1) for k, v in timings.items()},
    )
    del runner, shared
    return rows, facts


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
