"""The Llama both Hugging Face benchmarks generate with, and how they time its warm decode.

``transformers_generate`` measures each variant in a fresh process, ``tensor_parallel``
on every rank of a group; both build the same random-weight Llama (nothing is
downloaded), prompt it alike and take warm decode tokens/s the same way, so that
their figures compare.
"""

from __future__ import annotations

import statistics
import time

import torch


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


def model_generate(model, static_cache: bool):
    """``generate(input_ids, new_tokens) -> tokens``, transformers' own way: greedy, exactly
    ``new_tokens`` new, with its static cache (whose first call compiles the decode step) or its
    dynamic one."""
    extra = {"cache_implementation": "static"} if static_cache else {}

    def generate(ids, new):
        return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, **extra)

    return generate


def timed(fn) -> tuple[float, object]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, result


def capture_seconds(runner) -> float:
    """What a ``breakgraph`` runner's captures took so far, every size's together."""
    return sum(row["capture_ms"] for row in runner.report(print_table=False)["rows"]) / 1000


def warm_generations(generate, ids: torch.Tensor, new: int, repeats: int) -> dict:
    """The median of ``repeats`` warm generations (``warm_s``), decode tokens/s and ms per step,
    and the last generation's new tokens.

    Decode is a generation less a one-token generation (the prefill's share), over
    ``batch * (new - 1)`` tokens. A one-token generation's first call is cold (its shapes are
    new), so one runs untimed first.
    """
    batch, prompt = ids.shape
    generate(ids, 1)
    full, one = [], []
    for _ in range(repeats):
        seconds, tokens = timed(lambda: generate(ids, new))
        full.append(seconds)
        one.append(timed(lambda: generate(ids, 1))[0])
    warm = statistics.median(full)
    decode_s = warm - statistics.median(one)
    return {"warm_s": warm, "decode_tok_s": batch * (new - 1) / decode_s, "ms_per_step": decode_s / (new - 1) * 1e3, "tokens": tokens[:, prompt:].tolist()}


def agreement(tokens: list, reference: list) -> str:
    """How many leading tokens of every row equal the reference's, as "min/new"."""
    same = []
    for row, ref in zip(tokens, reference):
        count = next((i for i, (a, b) in enumerate(zip(row, ref)) if a != b), len(ref))
        same.append(count)
    return f"{min(same)}/{len(reference[0])}"
