"""Generation with a Hugging Face transformers Llama: breakgraph against transformers' own paths.

A Llama-3.2-1B-shaped model (random weights from a config: nothing is
downloaded) generates ``--new`` tokens after a ``--prompt``-token prompt
at each batch size, six ways, each cold in a fresh process (fresh
Inductor and Triton caches):

- transformers eager: ``model.generate`` with its dynamic cache and SDPA;
- transformers static cache + ``torch.compile(mode="reduce-overhead")``:
  ``model.generate(cache_implementation="static")``, which compiles the
  decode step on its first call (Inductor and cudagraph trees);
- breakgraph breakable: ``breakgraph.hf.Generator``, attention an eager
  break between graph segments;
- breakgraph full: the same Generator with ``mode="full"``, one graph per
  batch size with attention over the whole cache under a device mask;
- breakgraph breakable, sampling and breakgraph full, sampling: the same
  two, sampling (temperature 0.7, top_k 50, top_p 0.9) with the token drawn
  inside the graph, their capture the sampling step's;
- breakgraph breakable + compile and breakgraph full + compile: the same
  two with ``compile=True``, the decode step's forward compiled by
  ``torch.compile`` (Inductor, no CUDA graphs of its own) and the compiled
  kernels captured, attention the break;
- breakgraph breakable + compile in background: ``compile=True,
  compile_in_background=True``: the uncompiled graphs serve the first
  generation, Inductor compiles in a thread from its end, and generations
  go on meanwhile (their tokens/s together: ``compiling_tok_s``) until one
  takes the compiled step, at ``compiled_s`` from the start; its warm
  generations are the compiled step's.

The others decode greedily.

Reported per variant and batch size:

- *cold generation*: the wall time of the first ``generate()`` of
  ``--new`` tokens in the fresh process, from a loaded model: torch.compile's
  compile and breakgraph's capture are in it (the capture also on its own,
  ``capture_s``: the runner's capture time for the size the call captured,
  its eager warm-up included), and so is every first use of a shape (a kernel library
  may prepare its kernel for each new shape: cuDNN's attention builds a
  plan; breakable attention meets a new key length at every step). Its
  tokens/s: ``batch * new`` over it;
- *warm generation*: the median time of the same call once warm, and decode
  tokens per second (its time less that of one new token, itself timed
  after an untimed first call, over ``batch * (new - 1)`` tokens);
- peak memory beyond the weights; the graphs torch.compile compiled; and, for the greedy variants, how many
  of each row's tokens equal transformers' eager tokens (in bfloat16
  greedy paths may part after a near-tie; in float32 the GPU tests require
  them equal).

The ratios row of each batch size gives torch.compile's cold generation
over breakgraph's (target: at least 5x), breakgraph's cold generation over
its warm one (target: at most 1.5x), the warm decode tokens/s against
torch.compile's (target: the best breakgraph variant's at least 1.3x), and sampling's warm decode tokens/s over greedy's per
mode (target: at least 0.95x, sampling costing at most 5 %); a line per
breakgraph variant says whether each target is met. The run ends by
printing how long it took.

    python3 -m benchmarks.transformers_generate [--quick] [--out results] [--batches 1 8] [--variants ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from benchmarks.common import benchmark_parser, device_meta, require_gpu, verdict, write_outputs
from benchmarks.hf_generation import agreement, build_model
from benchmarks.transformers_generate_runs import SAMPLING, VARIANTS, measure_one, run_fresh
from breakgraph import hf

OURS = ("breakable", "full", "breakable_compile", "full_compile", "breakable_compile_background")  # the greedy breakgraph variants
COLD_TARGET = 5.0  # torch.compile's cold generation over breakgraph's, at least
WARM_TARGET = 1.5  # breakgraph's cold generation over its own warm one, at most
DECODE_TARGET = 1.3  # the best breakgraph variant's warm decode tokens/s over torch.compile's, at least
SAMPLING_TARGET = 0.95  # sampling's warm decode tokens/s over greedy's, same mode, at least
COLUMNS = [
    "variant", "batch", "cold_gen_s", "cold_tok_s", "capture_s", "compiled_s", "compiling_tok_s", "warm_gen_s", "warm_decode_tok_s",
    "ms_per_step", "memory_gib", "dynamo_graphs", "same_as_eager",
]

QUICK = dict(hf.LLAMA_3_2_1B, vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=32)


def row_of(variant: str, batch: int, new: int, result: dict, reference: list | None) -> dict:
    capture = result["capture_s"]
    return {
        "variant": VARIANTS[variant],
        "batch": batch,
        "cold_gen_s": round(result["cold_s"], 2),
        "cold_tok_s": round(batch * new / result["cold_s"], 1),
        "capture_s": round(capture, 3) if capture is not None else "-",
        "compiled_s": round(result["compiled_s"], 2) if result.get("compiled_s") is not None else "-",
        "compiling_tok_s": round(result["compiling_tok_s"], 1) if result.get("compiling_tok_s") is not None else "-",
        "warm_gen_s": round(result["warm_s"], 3),
        "warm_decode_tok_s": round(result["decode_tok_s"], 1),
        "ms_per_step": round(result["ms_per_step"], 3),
        "memory_gib": round(result["memory_gib"], 2),
        "dynamo_graphs": result["dynamo_graphs"],
        "same_as_eager": agreement(result["tokens"], reference) if reference else "-",
    }


def ratios(batch: int, measured: dict) -> tuple[dict, list[str]]:
    """The batch's ratios row (sampling's cost among them), and its target lines: the best breakgraph
    variant's decode against torch.compile's, then one per greedy breakgraph variant on the two
    cold targets."""
    ours = [variant for variant in OURS if variant in measured]
    compiled = measured.get("compile")
    row = {"variant": "ratios", "batch": batch}
    row["warm_gen_s"] = "; ".join(f"{v} cold/warm {measured[v]['cold_s'] / measured[v]['warm_s']:.2f}x" for v in ours)
    if compiled is not None:
        row["cold_gen_s"] = "; ".join(f"compile/{v} {compiled['cold_s'] / measured[v]['cold_s']:.1f}x" for v in ours)
        row["warm_decode_tok_s"] = "; ".join(f"{v}/compile {measured[v]['decode_tok_s'] / compiled['decode_tok_s']:.2f}x" for v in ours)
    costs = [f"{v} sampling/greedy {ratio:.2f}x" for v, ratio in sampling_over_greedy(measured).items()]
    if costs:
        row["warm_decode_tok_s"] = "; ".join(([row["warm_decode_tok_s"]] if "warm_decode_tok_s" in row else []) + costs)
    lines = []
    if compiled is not None and ours:
        best = max(ours, key=lambda v: measured[v]["decode_tok_s"])
        faster = measured[best]["decode_tok_s"] / compiled["decode_tok_s"]
        lines.append(
            f"batch {batch}, best breakgraph variant {VARIANTS[best]}: warm decode {faster:.2f}x torch.compile's tokens/s "
            f"({verdict(faster, DECODE_TARGET, at_most=False)})"
        )
    for variant in ours:
        cold, warm = measured[variant]["cold_s"], measured[variant]["warm_s"]
        line = f"batch {batch}, {VARIANTS[variant]}: cold generation {cold:.2f} s"
        if compiled is not None:
            faster = compiled["cold_s"] / cold
            line += f", {faster:.1f}x faster than torch.compile's {compiled['cold_s']:.2f} s ({verdict(faster, COLD_TARGET, at_most=False)})"
        line += f"; {cold / warm:.2f}x its warm {warm:.3f} s ({verdict(cold / warm, WARM_TARGET, at_most=True)})"
        lines.append(line)
    return row, lines


def sampling_over_greedy(measured: dict) -> dict[str, float]:
    """Each mode's warm decode tokens/s sampling over greedy, where both were measured."""
    return {
        v: measured[f"{v}_sampling"]["decode_tok_s"] / measured[v]["decode_tok_s"]
        for v in OURS
        if v in measured and f"{v}_sampling" in measured
    }


def sampling_costs(batch: int, measured: dict) -> list[str]:
    """A line per mode measured both ways: whether sampling costs at most 5 % of greedy's tokens/s."""
    return [
        f"batch {batch}, {VARIANTS[v]}: sampling decodes {measured[f'{v}_sampling']['decode_tok_s']:.1f} tokens/s, "
        f"{ratio:.2f}x greedy's {measured[v]['decode_tok_s']:.1f} ({verdict(ratio, SAMPLING_TARGET, at_most=False)})"
        for v, ratio in sampling_over_greedy(measured).items()
    ]


def draw(ax, rows, new: int):
    """Seconds per generation, log scale: the cold one light, the warm one dark in front of it."""
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    batches = sorted({r["batch"] for r in rows})
    width = 0.8 / len(variants)
    for i, variant in enumerate(variants):
        mine = {r["batch"]: r for r in rows if r["variant"] == variant}
        xs = [j + i * width for j, batch in enumerate(batches) if batch in mine]
        cold = [mine[batch]["cold_gen_s"] for batch in batches if batch in mine]
        bars = ax.bar(xs, cold, width, color=f"C{i}", alpha=0.35)
        ax.bar(xs, [mine[batch]["warm_gen_s"] for batch in batches if batch in mine], width, color=f"C{i}", label=variant)
        for bar, seconds in zip(bars, cold):
            ax.annotate(f"{seconds:.1f}s", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=7)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(batches))], [f"batch {batch}" for batch in batches])
    ax.set_yscale("log")
    ax.set_ylim(min(r["warm_gen_s"] for r in rows) / 3, max(r["cold_gen_s"] for r in rows) * 30)  # room for the legend above
    ax.set_ylabel(f"seconds to generate {new} tokens (lower is better)")
    ax.set_title(
        "Llama-3.2-1B shape, greedy or sampling: the first generate() in a fresh process (light,\n"
        "compile or capture included, labelled) and a warm one (dark)",
        fontsize=9,
    )


def parse(argv) -> argparse.Namespace:
    parser = benchmark_parser("transformers_generate", __doc__)
    parser.add_argument("--quick", action="store_true", help="small smoke run: a 2-layer model, 16-token prompts, 16 new tokens")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (128)")
    parser.add_argument("--new", type=int, default=None, help="new tokens (128)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=3, help="warm generations timed, the median kept")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--one", choices=list(VARIANTS), help=argparse.SUPPRESS)  # a child process: one measurement
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    require_gpu("transformers_generate")
    args.prompt = args.prompt or (16 if args.quick else 128)
    args.new = args.new or (16 if args.quick else 128)
    shape = QUICK if args.quick else hf.LLAMA_3_2_1B
    if args.one:  # the child of run_fresh: its measurement, written where the parent reads it
        model = build_model(shape, getattr(torch, args.dtype))
        measured = measure_one(args.one, model, args.batches[0], args.prompt, args.new, args.repeats)
        with open(args.result, "w") as out:
            json.dump(measured, out)
        return 0
    started = time.perf_counter()
    rows, targets, sampling_targets = measure_batches(args)
    report(args, rows, targets, sampling_targets, started)
    return 0


def measure_batches(args) -> tuple[list[dict], list[str], list[str]]:
    """Every variant at every batch size, each in a fresh process: the rows (a ratios row after
    each batch's), the target lines and the sampling target lines; each row printed as it comes."""
    rows, targets, sampling_targets = [], [], []
    for batch in args.batches:
        measured = {variant: run_fresh(variant, batch, args) for variant in args.variants}
        reference = measured.get("eager", {}).get("tokens")
        for variant, result in measured.items():
            rows.append(row_of(variant, batch, args.new, result, None if variant.endswith("_sampling") else reference))
            print(rows[-1], flush=True)
        if "compile" in measured and not measured["compile"]["compiled"]:
            raise RuntimeError("transformers did not compile its static-cache generation: the comparison would be void")
        if any(variant in measured for variant in OURS):
            row, lines = ratios(batch, measured)
            rows.append(row)
            targets += lines
            sampling_targets += sampling_costs(batch, measured)
            print(row, flush=True)
    return rows, targets, sampling_targets


def report(args, rows: list[dict], targets: list[str], sampling_targets: list[str], started: float) -> None:
    """Write the table, JSON and plot; print the targets and how long the run took."""
    meta = device_meta() | {"prompt": args.prompt, "new": args.new, "dtype": args.dtype, "model": "Llama-3.2-1B shape" if not args.quick else "tiny Llama"}
    import transformers

    meta["transformers"] = transformers.__version__
    meta["targets"] = targets
    meta["sampling_targets"] = sampling_targets
    meta["sampling"] = SAMPLING
    meta["run_s"] = round(time.perf_counter() - started, 1)
    write_outputs("transformers_generate", rows, COLUMNS, args.out, meta, lambda ax, measured: draw(ax, measured, args.new))
    print(
        f"targets: the best breakgraph variant's warm decode >= {DECODE_TARGET:g}x torch.compile's tokens/s; breakgraph's cold "
        f"generation >= {COLD_TARGET:g}x faster than torch.compile's, and within {WARM_TARGET:g}x of its own warm one"
    )
    for line in targets:
        print(f"  {line}")
    if sampling_targets:
        print(f"target: sampling's warm decode tokens/s >= {SAMPLING_TARGET:g}x greedy's, in each mode")
        for line in sampling_targets:
            print(f"  {line}")
    print(f"the whole run took {meta['run_s']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
