"""The break's attention: each row over its own cached tokens.

:func:`attend` is the ``@eager_on_graph`` break the breakable mode runs
between graph segments: it reads each row's length on the host and attends
over that many cached tokens, so a step costs attention over the tokens there
are. Its capturable variant :func:`attend_in_graph`, which the full mode
records, reads each row's position from a device tensor and attends over the
whole cache under a mask built on the device. Both run torch's scaled
dot-product attention with cuDNN's backend excluded
(:mod:`breakgraph.hf.sdpa` says why).
"""

from __future__ import annotations

import torch

import breakgraph as bg
from breakgraph.hf.cache import RowLengths
from breakgraph.hf.sdpa import scaled_dot_product_attention


def _grouped(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``(b, heads, q, d)`` as ``(b, kv_heads, groups * q, d)``: grouped-query attention as
    plain attention, each key/value head serving its group's queries, with no copy of the cache."""
    batch, heads, length, dim = query.shape
    return query.reshape(batch, kv_heads, heads // kv_heads * length, dim)


def _visible(ends: torch.Tensor, query_length: int, groups: int, slots: int) -> torch.Tensor:
    """Boolean mask ``(b, 1, groups * q, slots)``: query ``t`` of a row whose forward ends at
    ``end`` sees slots ``< end - q + 1 + t`` (causal, lower-right aligned)."""
    last = ends[:, None] - query_length + torch.arange(query_length, device=ends.device)  # (b, q): each query's slot
    last = last.repeat(1, groups)
    return (torch.arange(slots, device=ends.device) <= last[:, :, None])[:, None]


def _grouped_attention(query, keys, values, visible: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """``(b, heads, q, d)`` queries over ``(b, kv_heads, slots, d)`` caches where ``visible`` (from
    :func:`_visible`; None: every slot) allows, as ``(b, q, heads, d)``."""
    batch, heads, length, dim = query.shape
    out = scaled_dot_product_attention(_grouped(query, keys.shape[1]), keys, values, attn_mask=visible, scale=scaling)
    return out.reshape(batch, heads, length, dim).transpose(1, 2).contiguous()


@bg.eager_on_graph
def attend(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, lengths: RowLengths, scaling: float
) -> torch.Tensor:
    """Attention over each row's cached tokens, as many as ``lengths`` says on the host.

    Arguments:
        query (torch.Tensor): ``(b, heads, q, d)``, the forward's ``q`` new tokens per row.
        keys (torch.Tensor): ``(b, kv_heads, max_length, d)``, the rows' whole key cache; ``heads``
            a multiple of ``kv_heads`` (grouped-query attention).
        values (torch.Tensor): as ``keys``.
        positions (torch.Tensor): each row's first new slot, on the device. Not read here: the
            capturable variant :func:`attend_in_graph` reads the lengths from it instead.
        lengths (RowLengths): each row's tokens so far, the new ones included, on the host.
        scaling (float): the factor of the query-key products.

    Returns ``(b, q, heads, d)``, as transformers' attention functions do.
    """
    batch, heads, length, _dim = query.shape
    kv_heads = keys.shape[1]
    ends = lengths.for_rows(batch)
    longest = max(ends)
    keys, values = keys[:, :, :longest], values[:, :, :longest]
    if min(ends) == longest == length:  # every row a prefill from slot 0: plain causal attention
        out = scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scaling, enable_gqa=kv_heads != heads)
        return out.transpose(1, 2).contiguous()
    if min(ends) == longest and length == 1:  # decode, every row as long: nothing to mask
        visible = None
    else:
        visible = _visible(torch.tensor(ends, device=query.device), length, heads // kv_heads, longest)
    return _grouped_attention(query, keys, values, visible, scaling)


@attend.inline
def attend_in_graph(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, lengths: RowLengths, scaling: float
) -> torch.Tensor:
    """What full graphs record in place of :func:`attend`: every row's length from
    ``positions`` on the device, the whole cache attended under a mask.

    Arguments:
        query, keys, values, positions, lengths, scaling: as for :func:`attend`
            (``lengths`` is not read: the lengths come from ``positions``).
    """
    batch, heads, length, _dim = query.shape
    visible = _visible(positions[:batch] + length, length, heads // keys.shape[1], keys.shape[2])
    return _grouped_attention(query, keys, values, visible, scaling)
