"""The ``"breakgraph"`` attention implementation, as transformers' registries know it.

Under a :class:`~breakgraph.hf.Generator` (the cache of its forward under way
is set by :func:`generating_into`), attention is the break of
:mod:`breakgraph.hf.attention`, and there is no mask: the break knows each
row's length. Anywhere else (``model.generate()``, training) it is
transformers' own SDPA attention and mask, so selecting ``"breakgraph"``
changes nothing outside a Generator. What a model asks of attention that the
break does not apply is refused, never ignored.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from breakgraph.hf.attention import attend
from breakgraph.hf.cache import KVCache

ATTENTION = "breakgraph"
"""The name to select: ``model.set_attn_implementation(ATTENTION)``."""

_generating: contextvars.ContextVar[KVCache | None] = contextvars.ContextVar("breakgraph_hf_cache", default=None)
"""The cache of the Generator whose forward is under way in this context, if any."""

# What a model may pass attention that the break does not apply, by keyword.
_UNSUPPORTED = {"softcap": "logit soft-capping", "s_aux": "attention sinks"}


@contextlib.contextmanager
def generating_into(cache: KVCache) -> Iterator[None]:
    """Within: forwards in this context attend through ``cache``'s break."""
    token = _generating.set(cache)
    try:
        yield
    finally:
        _generating.reset(token)


def _refuse_what_the_break_does_not_apply(module: torch.nn.Module, dropout: float, cache: KVCache, options: dict) -> None:
    if dropout:
        raise ValueError("breakgraph's attention is for inference: put the model in eval mode (model.eval())")
    window = options.get("sliding_window")
    if window is not None and window < cache.token_capacity:
        raise NotImplementedError(
            f"{type(module).__name__} attends through a sliding window of {window} tokens, which breakgraph.hf "
            f"does not apply: give the Generator a max_length of at most {window}, or use a model without one"
        )
    for name, what in _UNSUPPORTED.items():
        if options.get(name) is not None:
            raise NotImplementedError(f"{type(module).__name__} asks attention for {what} ({name}=), which breakgraph.hf does not apply")


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **options: Any,
) -> tuple[torch.Tensor, None]:
    """The ``"breakgraph"`` attention implementation, with the signature transformers calls it by.

    Arguments:
        module (torch.nn.Module): the model's attention layer.
        query (torch.Tensor): ``(b, heads, q, d)``.
        key (torch.Tensor): ``(b, kv_heads, keys, d)``: under a Generator, the rows' whole cache.
        value (torch.Tensor): as ``key``.
        attention_mask (torch.Tensor or None): transformers' mask; None under a Generator.
        dropout (float): attention dropout; refused under a Generator unless 0.
        scaling (float or None): the factor of the query-key products; None: ``d ** -0.5``.
        **options: what else the model passes (``sliding_window``, ``softcap``, ``s_aux``, ...).
    """
    cache = _generating.get()
    if cache is None:  # not under a Generator: transformers' SDPA attention, as "sdpa" would run it
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **options)
    _refuse_what_the_break_does_not_apply(module, dropout, cache, options)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return attend(query, key, value, cache.positions, cache.lengths, scale), None


def attention_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """The ``"breakgraph"`` mask implementation: none under a Generator, whose attention knows each
    row's length (under capture transformers would otherwise build a mask into the graph that
    nothing reads); transformers' SDPA mask otherwise.

    Arguments:
        *args, **kwargs: what transformers passes its mask functions, handed to its SDPA mask.
    """
    return None if _generating.get() is not None else sdpa_mask(*args, **kwargs)


def register() -> None:
    """Register ``"breakgraph"`` with transformers' attention and mask registries (again: no change).

    ``import breakgraph.hf`` calls it; call it again where something replaced the entries.
    """
    AttentionInterface.register(ATTENTION, attention_forward)
    AttentionMaskInterface.register(ATTENTION, attention_mask)
