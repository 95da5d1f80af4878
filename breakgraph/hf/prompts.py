"""A generate() call's prompts, checked before anything runs: their shape against the cache, their
left padding, and their token ids against the model's vocabulary."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from breakgraph.hf.cache import KVCache


def prompt_lengths(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, max_new_tokens: int, cache: KVCache) -> list[int]:
    """Each row's prompt length, once the call is checked against ``cache``'s rows and slots."""
    if input_ids.ndim != 2 or 0 in input_ids.shape:
        raise ValueError(f"input_ids must be (batch, prompt length), with rows and a prompt, got shape {tuple(input_ids.shape)}")
    n, length = input_ids.shape
    if n > cache.row_capacity:
        raise ValueError(f"{n} prompts, but this Generator's cache holds {cache.row_capacity} rows (max_batch_size)")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if length + max_new_tokens > cache.token_capacity:
        raise ValueError(
            f"a {length}-token prompt and {max_new_tokens} new tokens need {length + max_new_tokens} cache slots, "
            f"but this Generator holds {cache.token_capacity} (max_length)"
        )
    if attention_mask is None:
        return [length] * n
    if tuple(attention_mask.shape) != (n, length):
        raise ValueError(f"attention_mask must be shaped as input_ids, {(n, length)}, got {tuple(attention_mask.shape)}")
    mask = attention_mask.to("cpu", torch.bool)
    lengths = mask.sum(1).tolist()
    for row, real in enumerate(lengths):
        if real == 0 or not bool(mask[row, length - real :].all()):
            raise ValueError(f"row {row} of attention_mask is not left-padded (zeros, then ones, at least one)")
    return lengths


def require_ids_in_vocabulary(model: PreTrainedModel, input_ids: torch.Tensor) -> None:
    """Refuse a token id the embedding has no row for: on a GPU, its lookup would be a
    device-side assert, which leaves the process's CUDA context unusable. One host read."""
    vocabulary = model.get_input_embeddings().num_embeddings
    lowest, highest = torch.stack(torch.aminmax(input_ids)).tolist()
    if lowest >= 0 and highest < vocabulary:
        return
    bad = lowest if lowest < 0 else highest
    row, position = (input_ids == bad).nonzero()[0].tolist()
    raise ValueError(
        f"input_ids holds token id {bad} (row {row}, position {position}), outside the model's vocabulary of "
        f"{vocabulary} tokens (ids 0 to {vocabulary - 1}): tokenize with the model's own tokenizer"
    )
