"""The variants ``transformers_generate`` measures, each in a fresh process: how each generates,
and its cold and warm generations.

A variant's first generation is measured cold, as a new server meets it: in a process of its
own, with empty Inductor and Triton caches, so that no compile, capture or first use of a
shape is left from another variant. The child is ``transformers_generate`` itself, given
``--one``; it writes its result where the parent reads it.
"""

from __future__ import annotations

import functools
import os
import tempfile
import time

import torch
from torch._dynamo.utils import counters

from benchmarks.common import run_child
from benchmarks.hf_generation import capture_seconds, model_generate, prompts, timed, warm_generations
from breakgraph import hf

VARIANTS = {
    "eager": "transformers eager",
    "compile": "transformers static + torch.compile",
    "breakable": "breakgraph breakable",
    "full": "breakgraph full",
    "breakable_sampling": "breakgraph breakable, sampling",
    "full_sampling": "breakgraph full, sampling",
    "breakable_compile": "breakgraph breakable + compile",
    "full_compile": "breakgraph full + compile",
    "breakable_compile_background": "breakgraph breakable + compile in background",
}
SAMPLING = {"do_sample": True, "temperature": 0.7, "top_k": 50, "top_p": 0.9}


def generator_for(variant: str, model, batch: int, max_length: int):
    """``(generate, captured, background)``: ``generate(input_ids, new_tokens) -> tokens``
    the variant's way; ``captured()``, what breakgraph's captures took so far, which the
    first ``generate`` makes (None for transformers' paths, whose compile happens inside their
    first ``generate``); and the Generator that compiles in the background (None where none does)."""
    if variant in ("eager", "compile"):
        return model_generate(model, static_cache=variant == "compile"), None, None
    mode, _, how = variant.partition("_")
    in_background = how == "compile_background"
    model.set_attn_implementation(hf.ATTENTION)
    generator = hf.Generator(
        model, max_length=max_length, max_batch_size=batch, mode=mode, progress=False, compile=how.startswith("compile"),
        compile_in_background=in_background,
    )
    background = generator if in_background else None
    runner = generator.sampling_runner if how == "sampling" else generator.runner

    captured = functools.partial(capture_seconds, runner)
    if how != "sampling":
        return generator.generate, captured, background

    def generate(ids, new):
        return generator.generate(ids, new, **SAMPLING)

    return generate, captured, background


def measure_one(variant: str, model, batch: int, prompt: int, new: int, repeats: int) -> dict:
    """One variant at one batch size on ``model``, just built in this (fresh) process: its cold
    generation, then warm ones."""
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_reserved()  # the model, and nothing its construction left
    torch.cuda.reset_peak_memory_stats()
    ids = prompts(batch, prompt, model.config.vocab_size, seed=batch)
    torch.cuda.synchronize()
    started = time.perf_counter()
    generate, captured, background = generator_for(variant, model, batch, prompt + new)
    generate(ids, new)  # the first generation: every compile, capture and first use of a shape is in it
    torch.cuda.synchronize()
    cold = time.perf_counter() - started
    capture_s = captured() if captured is not None else None
    compiled_s = compiling_tok_s = None
    if background is not None:
        served = []
        while background.compiling:  # the last of these takes the compiled step: captures it, then generates
            served.append(timed(lambda: generate(ids, new))[0])
        compiled_s = time.perf_counter() - started
        compiling_tok_s = batch * new * len(served) / sum(served)
    warm = warm_generations(generate, ids, new, repeats)
    return {
        "cold_s": cold,
        "capture_s": capture_s,
        "compiled_s": compiled_s,
        "compiling_tok_s": compiling_tok_s,
        **warm,
        "memory_gib": (torch.cuda.max_memory_reserved() - weights) / 2**30,
        "compiled": hasattr(model, "_compiled_call"),
        "dynamo_graphs": counters["stats"]["unique_graphs"],  # what torch.compile compiled in the process
    }


def run_fresh(variant: str, batch: int, args) -> dict:
    """``measure_one`` in a fresh process with empty compile caches: cold, as a new server starts."""
    with tempfile.TemporaryDirectory() as caches:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=f"{caches}/inductor", TRITON_CACHE_DIR=f"{caches}/triton")
        arguments = ["--one", variant, "--batches", str(batch), "--prompt", str(args.prompt), "--new", str(args.new)]
        arguments += ["--dtype", args.dtype, "--repeats", str(args.repeats), "--out", args.out]  # the child checks --out as the parent did
        arguments += ["--quick"] if args.quick else []
        return run_child("benchmarks.transformers_generate", arguments, env, timeout=900, what=f"{VARIANTS[variant]} at batch {batch}")
