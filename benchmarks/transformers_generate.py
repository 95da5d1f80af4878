"""Greedy generation with a Hugging Face transformers Llama: breakgraph against transformers' own paths.

A Llama-3.2-1B-shaped model (random weights from a config: nothing is
downloaded) generates ``--new`` tokens after a ``--prompt``-token prompt
at each batch size, four ways, each cold in a fresh process (fresh
Inductor and Triton caches):

- transformers eager: ``model.generate`` with its dynamic cache and SDPA;
- transformers static cache + ``torch.compile(mode="reduce-overhead")``:
  ``model.generate(cache_implementation="static")``, which compiles the
  decode step on its first call (Inductor and cudagraph trees);
- breakgraph breakable: ``breakgraph.hf.Generator``, attention an eager
  break between graph segments;
- breakgraph full: the same Generator with ``mode="full"``, one graph per
  batch size with attention over the whole cache under a device mask.

Reported per variant and batch size: *ready*, the seconds from a loaded
model to the first token of the decode path (one cold call generating two
tokens: prefill, then the first decode step with its compile or capture);
decode tokens per second once warm (the warm time of ``--new`` tokens less
that of one, over ``batch * (new - 1)`` tokens); peak memory beyond the
weights; and how many of each row's tokens equal transformers' eager
tokens (in bfloat16 greedy paths may part after a near-tie; in float32 the
GPU tests require them equal).

    python -m benchmarks.transformers_generate [--quick] [--out results] [--batches 1 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks.common import device_meta, plot_grouped_bars, require_gpu, write_outputs
from breakgraph import hf

VARIANTS = {
    "eager": "transformers eager",
    "compile": "transformers static + torch.compile",
    "breakable": "breakgraph breakable",
    "full": "breakgraph full",
}

QUICK = dict(hf.LLAMA_3_2_1B, vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=32)


def build_model(shape: dict, dtype: torch.dtype, seed: int = 0):
    """The Llama of ``shape`` with seeded random weights, in eval mode on the GPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**shape)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(dtype)
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = None
    return model.eval()


def prompts(batch: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=generator).cuda()


def generator_for(variant: str, model, batch: int, max_length: int):
    """A function ``(input_ids, new_tokens) -> tokens`` generating the variant's way; the first
    call compiles or captures."""
    if variant in ("eager", "compile"):
        extra = {"cache_implementation": "static"} if variant == "compile" else {}

        def generate(ids, new):
            return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, **extra)

        return generate
    model.set_attn_implementation(hf.ATTENTION)
    generator = hf.Generator(model, max_length=max_length, max_batch_size=batch, mode=variant, progress=False)
    return generator.generate


def timed(fn) -> tuple[float, object]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, result


def measure_one(variant: str, batch: int, prompt: int, new: int, shape: dict, dtype: torch.dtype, repeats: int) -> dict:
    """One variant at one batch size, in this (fresh) process."""
    model = build_model(shape, dtype)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_reserved()  # the model, and nothing its construction left
    torch.cuda.reset_peak_memory_stats()
    ids = prompts(batch, prompt, shape["vocab_size"], seed=batch)
    torch.cuda.synchronize()
    started = time.perf_counter()
    generate = generator_for(variant, model, batch, prompt + new)
    generate(ids, 2)
    torch.cuda.synchronize()
    ready = time.perf_counter() - started
    timed(lambda: generate(ids, new))  # a warm-up of the full length (cudagraph trees record here)
    full, one = [], []
    for _ in range(repeats):
        full.append(timed(lambda: generate(ids, new))[0])
        one.append(timed(lambda: generate(ids, 1))[0])
    tokens = generate(ids, new)
    decode_s = statistics.median(full) - statistics.median(one)
    return {
        "ready_s": ready,
        "decode_tok_s": batch * (new - 1) / decode_s,
        "ms_per_step": decode_s / (new - 1) * 1e3,
        "memory_gib": (torch.cuda.max_memory_reserved() - weights) / 2**30,
        "tokens": tokens[:, prompt:].tolist(),
        "compiled": hasattr(model, "_compiled_call"),
    }


def run_fresh(variant: str, batch: int, args) -> dict:
    """``measure_one`` in a fresh process with empty compile caches: cold, as a new server starts."""
    with tempfile.TemporaryDirectory() as caches, tempfile.NamedTemporaryFile("r", suffix=".json") as result:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=f"{caches}/inductor", TRITON_CACHE_DIR=f"{caches}/triton")
        command = [sys.executable, "-m", "benchmarks.transformers_generate", "--one", variant, "--batches", str(batch), "--result", result.name]
        command += ["--prompt", str(args.prompt), "--new", str(args.new), "--dtype", args.dtype, "--repeats", str(args.repeats)]
        command += ["--quick"] if args.quick else []
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"{VARIANTS[variant]} at batch {batch} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
        return json.loads(open(result.name).read())


def agreement(tokens: list, reference: list) -> str:
    """How many leading tokens of every row equal the reference's, as "min/new"."""
    same = []
    for row, ref in zip(tokens, reference):
        count = next((i for i, (a, b) in enumerate(zip(row, ref)) if a != b), len(ref))
        same.append(count)
    return f"{min(same)}/{len(reference[0])}"


def draw(ax, rows):
    plot_grouped_bars(ax, rows, "batch", "decode_tok_s", lambda b: f"batch {b}")
    ax.set_ylabel("decode tokens/s (higher is better)")
    ax.set_title("Llama-3.2-1B shape, greedy: decode throughput (labels: seconds until ready, cold)")
    for patch, row in zip(ax.patches, sorted(rows, key=lambda r: (list(VARIANTS.values()).index(r["variant"]), r["batch"]))):
        ax.annotate(f"{row['ready_s']:.1f}s", (patch.get_x() + patch.get_width() / 2, patch.get_height()), ha="center", va="bottom", fontsize=7)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small smoke run: a 2-layer model, short prompts")
    parser.add_argument("--out", default="results")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (128)")
    parser.add_argument("--new", type=int, default=None, help="new tokens (128)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--one", choices=list(VARIANTS), help=argparse.SUPPRESS)  # a child process: one measurement
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    require_gpu("transformers_generate")
    args.prompt = args.prompt or (16 if args.quick else 128)
    args.new = args.new or (16 if args.quick else 128)
    args.repeats = args.repeats or (1 if args.quick else 3)
    shape = QUICK if args.quick else hf.LLAMA_3_2_1B
    if args.one:
        measured = measure_one(args.one, args.batches[0], args.prompt, args.new, shape, getattr(torch, args.dtype), args.repeats)
        with open(args.result, "w") as out:
            json.dump(measured, out)
        return 0
    if not torch.cuda.is_available():
        print("transformers_generate needs a CUDA GPU; nothing measured")
        return 0
    rows = []
    for batch in args.batches:
        measured = {variant: run_fresh(variant, batch, args) for variant in args.variants}
        reference = measured.get("eager", {}).get("tokens")
        for variant, result in measured.items():
            rows.append(
                {
                    "variant": VARIANTS[variant],
                    "batch": batch,
                    "ready_s": round(result["ready_s"], 2),
                    "decode_tok_s": round(result["decode_tok_s"], 1),
                    "ms_per_step": round(result["ms_per_step"], 3),
                    "memory_gib": round(result["memory_gib"], 2),
                    "same_as_eager": agreement(result["tokens"], reference) if reference else "-",
                }
            )
            print(rows[-1], "compiled" if result["compiled"] else "", flush=True)
        if "compile" in measured:
            compiled = measured["compile"]
            if not compiled["compiled"]:
                raise RuntimeError("transformers did not compile its static-cache generation: the comparison would be void")
            ours = [variant for variant in ("breakable", "full") if variant in measured]
            ready = "; ".join(f"compile/{v} {compiled['ready_s'] / measured[v]['ready_s']:.1f}x" for v in ours)
            decode = "; ".join(f"{v}/compile {measured[v]['decode_tok_s'] / compiled['decode_tok_s']:.2f}x" for v in ours)
            ratios = {"variant": "ratios", "batch": batch, "ready_s": ready, "decode_tok_s": decode}
            rows.append(ratios)
            print(ratios, flush=True)
    columns = ["variant", "batch", "ready_s", "decode_tok_s", "ms_per_step", "memory_gib", "same_as_eager"]
    meta = device_meta() | {"prompt": args.prompt, "new": args.new, "dtype": args.dtype, "model": "Llama-3.2-1B shape" if not args.quick else "tiny Llama"}
    import transformers

    meta["transformers"] = transformers.__version__
    write_outputs("transformers_generate", rows, columns, args.out, meta, draw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
