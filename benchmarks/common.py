"""Shared pieces of the benchmarks: timing, output files, the table."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import breakgraph as bg
from breakgraph.base.command_line import refuse_unknown_arguments, write_problem
from breakgraph.base.runtime import cuda_problem


class BenchmarkParser(argparse.ArgumentParser):
    """argparse, but an unknown option is answered with the closest one the benchmark takes."""

    def parse_args(self, args=None, namespace=None):
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            refuse_unknown_arguments(self, unknown)
        return parsed


def benchmark_parser(name: str, description: str, command: str | None = None) -> BenchmarkParser:
    """A benchmark's parser, with the ``--out`` folder every benchmark writes to.

    Its usage line gives ``command`` (default ``python3 -m benchmarks.<name>``): argparse's own,
    the file's path, fails to import ``benchmarks``. ``--out`` is checked when the command line
    is read, not when the results are written at the end of a run.
    """
    parser = BenchmarkParser(
        prog=command or f"python3 -m benchmarks.{name}", description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=_out_folder, default="results", metavar="FOLDER", help="where the results go, made if missing (default results)")
    return parser


def _out_folder(text: str) -> str:
    problem = write_problem(Path(text))
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{problem}; give --out a folder you can write (it is made if missing)")
    return text


def require_gpu(benchmark: str) -> None:
    """Leave with status 2, saying why, where no CUDA GPU can run ``benchmark``: every benchmark
    measures graphs on a GPU, and torch's own errors without one name no benchmark."""
    problem = cuda_problem()
    if problem is not None:
        print(f"python3 -m benchmarks.{benchmark} needs a CUDA GPU ({problem}); nothing was measured", file=sys.stderr)
        raise SystemExit(2)


def verdict(ratio: float, target: float, at_most: bool) -> str:
    """Whether ``ratio`` meets ``target`` (at most it, or at least it), as a target line says it."""
    return "met" if (ratio <= target if at_most else ratio >= target) else "NOT met"


def run_child(module: str, arguments: list[str], env: dict, timeout: float, what: str) -> dict:
    """``python -m module arguments --result FILE`` in a fresh process (a cold start, as a
    server's): the JSON the child wrote to FILE. Raises, naming ``what`` it measured and
    with the end of the child's output, where it fails, runs past ``timeout`` seconds or
    writes no result."""
    with tempfile.NamedTemporaryFile("r", suffix=".json") as result:
        command = [sys.executable, "-m", module, *arguments, "--result", result.name]
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as late:
            raise RuntimeError(f"{what} ran past {timeout:g} s:{_output_tail(late.stdout, late.stderr)}") from None
        written = Path(result.name).read_text()  # where the child wrote, however it wrote it
        if done.returncode != 0 or not written:
            failed = "failed" if done.returncode != 0 else "wrote no result"
            raise RuntimeError(f"{what} {failed}:{_output_tail(done.stdout, done.stderr)}")
        return json.loads(written)


def _output_tail(stdout: str | bytes | None, stderr: str | bytes | None) -> str:
    """The end of a child's output (a timeout hands it over as bytes)."""
    text = [part.decode(errors="replace") if isinstance(part, bytes) else part or "" for part in (stdout, stderr)]
    return f"\n{text[0][-3000:]}\n{text[1][-6000:]}"


def time_per_call_us(fn, iters: int, repeats: int = 5) -> float:
    """Median over ``repeats`` of the wall time per call of ``fn`` (host issue + GPU drain), in µs."""
    results = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        results.append((time.perf_counter() - start) / iters * 1e6)
    return statistics.median(results)


def time_variants(variants: dict, iters: int, repeats: int = 7) -> dict:
    """Median µs per call of each variant; the repeats are interleaved (a, b, c, a, b, c, …)
    so that the machine's drift during the run falls on every variant alike."""
    samples = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            samples[name].append(time_per_call_us(fn, iters, repeats=1))
    return {name: statistics.median(values) for name, values in samples.items()}


def time_alternated(variants: dict, rounds: int, seed: int = 0) -> dict:
    """Median µs of one call of each variant, for calls that end synchronized (a training
    step's host reads): every round calls each variant once, in a shuffled order, and
    times each call on its own.

    The host drifts (on a shared host a variant's step can take a third longer from one
    second to the next): calling the variants in turn puts the same drift on each, so their
    ratios hold where blocks of one variant's calls, timed apart, moved them by several
    percent. A median of single calls sets aside those a pause on the host lengthened.
    """
    order, shuffle = list(variants), random.Random(seed).shuffle
    samples = {name: [] for name in order}
    clock = time.perf_counter_ns
    for _ in range(rounds):
        shuffle(order)
        for name in order:
            fn = variants[name]
            start = clock()
            fn()
            samples[name].append((clock() - start) / 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def synchronized(run):
    """``run`` followed by a device synchronize: one call of a step whose time ends on the GPU."""

    def step():
        run()
        torch.cuda.synchronize()

    return step


def write_outputs(name: str, rows: list[dict], columns: list[str], out_dir: str | Path, meta: dict, draw) -> Path:
    """Print the table, write ``<name>.json`` and ``<name>.png``; return the output folder.

    ``draw(ax, rows)`` plots the measured rows (the "ratios" summary rows left out).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(bg.format_table(rows, columns))
    (out_dir / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    draw(ax, [row for row in rows if row["variant"] != "ratios"])
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / f"{name}.png", dpi=120)
    plt.close(fig)
    print(f"wrote {out_dir / (name + '.json')} and {out_dir / (name + '.png')}")
    return out_dir


def plot_lines(ax, rows: list[dict], x: str, y: str) -> None:
    """One line per variant: ``y`` against ``x`` (log2 x axis)."""
    for variant in dict.fromkeys(r["variant"] for r in rows):
        points = [(r[x], r[y]) for r in rows if r["variant"] == variant]
        ax.plot(*zip(*points), marker="o", label=variant)
    ax.set_xscale("log", base=2)


def plot_grouped_bars(ax, rows: list[dict], group: str, y: str, group_label) -> None:
    """Bars of ``y`` grouped by ``group`` (one bar per variant in each group; none where a
    group has no row of that variant)."""
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    groups = sorted({r[group] for r in rows})
    width = 0.8 / len(variants)
    for i, variant in enumerate(variants):
        values = [next((r[y] for r in rows if r["variant"] == variant and r[group] == g), float("nan")) for g in groups]
        ax.bar([j + i * width for j in range(len(groups))], values, width, label=variant)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))], [group_label(g) for g in groups])


@bg.eager_on_graph
def noop():
    """A break with no work: what the benchmarks put between segments."""
    return None


def replay_each(graphs, between):
    """How engines replay one ``torch.cuda.CUDAGraph`` per segment: a Python loop,
    calling ``between`` (the eager break) after each graph."""

    def replay():
        for graph in graphs:
            graph.replay()
            between()

    return replay


def device_meta() -> dict:
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }
