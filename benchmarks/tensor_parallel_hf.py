"""The hf part of ``tensor_parallel``: a Llama loaded tensor parallel by its own plan, generating.

Rank 0 writes the random-weight Llama with ``save_pretrained`` and every rank
loads its shard with ``from_pretrained(..., tp_plan="auto")``, as a served
checkpoint is loaded; each variant's warm decode is then measured on every
rank as ``transformers_generate`` measures it. transformers is imported only
when this part runs: it is optional.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
import warnings

import torch
import torch.distributed as dist

from benchmarks.common import verdict
from benchmarks.decoder import TensorParallel
from benchmarks.hf_generation import agreement, build_model, model_generate, prompts, warm_generations
from benchmarks.tensor_parallel_ranks import on_every_rank

GENERATE = "generate"  # the part, as the table's "part" column names it
HF = {
    "eager": "transformers eager",
    "compile": "transformers static + torch.compile",
    "breakable": "breakgraph breakable",
    "full": "breakgraph full",
    "breakable_compile": "breakgraph breakable + compile",
}
OURS = ("breakable", "full", "breakable_compile")
HF_BATCHES = (1, 8)
DECODE_TARGET = 1.3  # the best breakgraph variant's decode tokens/s over torch.compile's, at least


def checkpoint_folder(tp: TensorParallel, needed_bytes: int) -> str:
    """A new folder every rank of this host can read, named by rank 0: in shared memory where it has room."""
    folder = [None]
    if tp.rank == 0:
        room = os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 2 * needed_bytes
        folder[0] = tempfile.mkdtemp(prefix="breakgraph-tp-", dir="/dev/shm" if room else None)
    dist.broadcast_object_list(folder, src=dist.get_global_rank(tp.group, 0), group=tp.group)
    return folder[0]


def checkpoint_bytes(shape: dict) -> int:
    """What ``save_pretrained`` writes for the Llama of ``shape`` in bf16 (tied embeddings written once)."""
    hidden, heads = shape["hidden_size"], shape["num_attention_heads"]
    head_dim = shape.get("head_dim") or hidden // heads
    attention = 2 * hidden * heads * head_dim + 2 * hidden * shape["num_key_value_heads"] * head_dim
    layer = attention + 3 * hidden * shape["intermediate_size"] + 2 * hidden
    embeddings = shape["vocab_size"] * hidden * (1 if shape.get("tie_word_embeddings") else 2)
    return 2 * (embeddings + shape["num_hidden_layers"] * layer + hidden)


def load_model(shape: dict, tp: TensorParallel):
    """The Llama of ``shape``, random weights in bf16: written by rank 0, loaded by every rank (its shard)."""
    from transformers import AutoModelForCausalLM

    folder = checkpoint_folder(tp, checkpoint_bytes(shape))
    try:
        if tp.rank == 0:
            built = build_model(shape, torch.bfloat16)
            built.save_pretrained(folder)
            del built
            torch.cuda.empty_cache()
        dist.barrier()
        split = {"tp_plan": "auto"} if tp.world > 1 else {"device_map": torch.device("cuda", torch.cuda.current_device())}
        with warnings.catch_warnings():  # transformers 5.17 on would take the plan in a DistributedConfig
            warnings.filterwarnings("ignore", message="Passing `tp_plan` directly", category=FutureWarning)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, **split)
        dist.barrier()
    finally:
        if tp.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = None
    return model.eval()


def make_generate(variant: str, model, max_length: int, batches):
    """``generate(input_ids, new_tokens) -> tokens``, the variant's way."""
    from breakgraph import hf

    if variant in ("eager", "compile"):
        return model_generate(model, static_cache=variant == "compile")
    mode, _, how = variant.partition("_")
    model.set_attn_implementation(hf.ATTENTION)
    generator = hf.Generator(
        model, max_length=max_length, max_batch_size=max(batches), capture_sizes=sorted(batches), mode=mode,
        progress=False, compile=how == "compile",
    )
    return generator.generate


def warm_decode(generate, ids: torch.Tensor, new: int, repeats: int) -> dict:
    """Warm decode tokens/s as ``transformers_generate`` measures it, and the last generation's new tokens."""
    generate(ids, new)  # the first: compiles, captures, first uses of shapes
    return warm_generations(generate, ids, new, repeats)


def generate_ratios(batch: int, measured: dict, failed: dict, compiled: bool, world: int) -> tuple[dict, list[str]]:
    """The batch's ratios row and target line from {variant: result} and {variant: why it failed}."""
    ours = [variant for variant in OURS if variant in measured]
    row = {"part": GENERATE, "batch": batch, "variant": "ratios"}
    if "compile" not in measured:
        why = failed.get("compile", "not measured")
        row["notes"] = f"no torch.compile figure to compare with ({why})"
        return row, [f"batch {batch}: transformers static + torch.compile failed at T = {world} ({why}): no ratio"]
    if not ours:
        row["notes"] = "no breakgraph variant ran"
        return row, [f"batch {batch}: no breakgraph variant ran: no ratio"]
    reference = measured["compile"]["decode_tok_s"]
    row["notes"] = "; ".join(f"{variant}/compile {measured[variant]['decode_tok_s'] / reference:.2f}x" for variant in ours)
    best = max(ours, key=lambda variant: measured[variant]["decode_tok_s"])
    ratio = measured[best]["decode_tok_s"] / reference
    line = (
        f"batch {batch}: best breakgraph variant {HF[best]}: {ratio:.2f}x torch.compile's decode tokens/s "
        f"(target >= {DECODE_TARGET:g}x: {verdict(ratio, DECODE_TARGET, at_most=False)})"
    )
    if not compiled:
        line += "; transformers did not compile its static-cache generation, so its figure is uncompiled"
    return row, [line]


def measure_generation(variant: str, model, ids: dict, args, tp: TensorParallel) -> tuple[dict, dict]:
    """One variant's results at each batch size of ``ids`` ({batch: prompts}), and why it has none
    at the others: a failure ends the variant, since it would fail again, slowly."""
    loud = tp.rank == 0  # rank 0 prints a failure's traceback, the others its first line
    generate, why = on_every_rank(lambda: make_generate(variant, model, args.prompt + args.new, list(ids)), tp, loud)
    results, failures = {}, {}
    for batch, prompt_ids in ids.items():
        if why is None:
            result, why = on_every_rank(lambda: warm_decode(generate, prompt_ids, args.new, args.repeats), tp, loud)
            if why is None:
                results[batch] = result
                continue
            failures[batch] = why
            why = f"not tried after failing at batch {batch}"
        else:
            failures[batch] = why
    return results, failures


def hf_part(args, tp: TensorParallel) -> tuple[list, list, dict]:
    import transformers

    from breakgraph import hf

    transformers.logging.disable_progress_bar()
    if tp.rank:
        transformers.logging.set_verbosity_error()
    shape = dict(hf.LLAMA_3_2_1B, num_hidden_layers=2) if args.quick else hf.LLAMA_3_2_1B
    model = load_model(shape, tp)
    ids = {batch: prompts(batch, args.prompt, shape["vocab_size"], seed=batch) for batch in HF_BATCHES}
    measured, failed = measure_variants(model, ids, args, tp)
    compiled = hasattr(model, "_compiled_call")  # transformers compiled its static-cache generation
    rows, lines = [], []
    for batch in HF_BATCHES:
        rows += variant_rows(batch, measured[batch], failed[batch])
        row, batch_lines = generate_ratios(batch, measured[batch], failed[batch], compiled, tp.world)
        rows.append(row)
        lines += batch_lines
    about = {"model": "Llama-3.2-1B shape" + (", 2 layers" if args.quick else ""), "prompt": args.prompt, "new": args.new,
             "repeats": args.repeats, "transformers": transformers.__version__, "transformers_compiled": compiled}
    return rows, lines, about


def measure_variants(model, ids: dict, args, tp: TensorParallel) -> tuple[dict, dict]:
    """{batch: {variant: result}} and {batch: {variant: why it failed}}, every variant in turn,
    each one's compiled code and graphs let go before the next."""
    measured = {batch: {} for batch in HF_BATCHES}
    failed = {batch: {} for batch in HF_BATCHES}
    for variant in HF:
        results, failures = measure_generation(variant, model, ids, args, tp)
        for batch, result in results.items():
            measured[batch][variant] = result
        for batch, why in failures.items():
            failed[batch][variant] = why
        if variant == "compile":
            torch._dynamo.reset()  # its compiled code and cudagraph trees, done with
        gc.collect()  # a Generator and its graphs
        torch.cuda.empty_cache()
    return measured, failed


def variant_rows(batch: int, measured: dict, failed: dict) -> list[dict]:
    """The batch's row per variant: its decode figures and its tokens against eager's, or why it failed."""
    reference = measured.get("eager", {}).get("tokens")
    rows = []
    for variant in HF:
        row = {"part": GENERATE, "batch": batch, "variant": HF[variant]}
        if variant in measured:
            result = measured[variant]
            row |= {"ms": round(result["ms_per_step"], 3), "tokens_per_s": round(result["decode_tok_s"], 1)}
            row["same_as_eager"] = agreement(result["tokens"], reference) if reference and variant != "eager" else "-"
        else:
            row |= {"ms": "failed", "notes": failed[variant]}
        rows.append(row)
    return rows
