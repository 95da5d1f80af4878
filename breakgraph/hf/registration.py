"""The ``"breakgraph"`` attention implementation, as transformers' registries know it.

Under a :class:`~breakgraph.hf.Generator` (the cache of its forward under way
is set by :func:`generating_into`), attention is the break of
:mod:`breakgraph.hf.attention`, and there is no mask: the break knows each
row's length. Anywhere else (``model.generate()``, training) it is
transformers' own SDPA attention and mask, so selecting ``"breakgraph"``
changes nothing outside a Generator. What a model asks of attention that the
break does not apply is refused, never ignored.

A Generator's compiled decode step (``Generator(compile=True)``) passes its
cache as the keyword :data:`COMPILED_CACHE`, which transformers hands on to
attention. Dynamo cannot read the context variable that says which cache a
forward writes, so under that keyword attention is the custom op
``breakgraph::hf_attention``: opaque to Dynamo, so the compiled model stays
one graph, and calling the break when it runs, so the capture splits there.
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

COMPILED_CACHE = "breakgraph_cache"
"""The keyword a Generator's compiled step passes its cache to attention by."""

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
        attention_mask (torch.Tensor or None): transformers' mask; not read under a Generator.
        dropout (float): attention dropout; refused under a Generator unless 0.
        scaling (float or None): the factor of the query-key products; None: ``d ** -0.5``.
        **options: what else the model passes (``sliding_window``, ``softcap``, ``s_aux``, ...).
    """
    cache = options.pop(COMPILED_CACHE, None)  # a Generator's compiled step, being traced or run
    compiled = cache is not None
    if not compiled:
        cache = _generating.get()
    if cache is None:  # not under a Generator: transformers' SDPA attention, as "sdpa" would run it
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **options)
    _refuse_what_the_break_does_not_apply(module, dropout, cache, options)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if compiled:
        return torch.ops.breakgraph.hf_attention(query, key, value, scale), None
    return attend(query, key, value, cache.positions, cache.lengths, scale), None


@torch.library.custom_op("breakgraph::hf_attention", mutates_args=())
def _attention_op(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
    """The break as a compiled step calls it: the cache it reads each row's length and position
    from is the Generator's whose forward runs (:func:`generating_into`)."""
    cache = _generating.get()
    if cache is None:
        raise RuntimeError(f"breakgraph's compiled attention ran outside a Generator's forward: pass {COMPILED_CACHE}= only from one")
    return attend(query, keys, values, cache.positions, cache.lengths, scaling)


@_attention_op.register_fake
def _(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
    batch, heads, length, dim = query.shape
    return query.new_empty(batch, length, heads, dim)


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
