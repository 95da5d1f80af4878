"""The benchmark decoder's attention, the part a graph cannot hold, and the break that holds its place.

The eager attention reads the KV cache up to a live length kept in a host-side
metadata object that the engine changes every step (as vLLM's attention
metadata), so its shapes change every step; its capturable variant reads each
row's position from a device tensor instead. :data:`attention_break` is the
eager one as an ``@eager_on_graph`` break, recording the capturable one inline
in full graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

import breakgraph as bg
from benchmarks.decode_attention import split_k_decode


class AttentionMetadata:
    """What the engine updates in place before every step: tokens already in the cache
    (``length``, on the host) and, for full graphs, each row's write slot on the device
    (``positions``)."""

    def __init__(self, length: int, positions: torch.Tensor | None = None):
        self.length = length
        self.positions = positions



def attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
    """Append this step's keys and values at ``meta.length``; attend over the live prefix.

    ``q`` [batch, heads, head_dim]; ``k``, ``v`` [batch, kv_heads, head_dim];
    caches [batch, capacity, kv_heads, head_dim] (token-major, as flash
    attention's variable-length kernels read them). The prefix length is read
    from the host object, so every step has new shapes.
    """
    length = meta.length
    k_cache[:, length] = k
    v_cache[:, length] = v
    keys, values = live_keys_values(k_cache, v_cache, length + 1)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, enable_gqa=True)
    return out.reshape(q.shape[0], -1)


def live_keys_values(k_cache, v_cache, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``length`` cached keys and values as SDPA reads them, [batch, kv_heads, length, head_dim]."""
    return k_cache[:, :length].transpose(1, 2), v_cache[:, :length].transpose(1, 2)


def attention_backend(q, k_cache, v_cache, length: int) -> str:
    """The SDPA backend :func:`attention` runs at a live ``length`` ("CUDNN_ATTENTION",
    "FLASH_ATTENTION", ...). cuDNN's builds a plan for every new shape, so there each new
    length pays for one, once per batch size."""
    keys, values = live_keys_values(k_cache, v_cache, length + 1)
    return SDPBackend(torch._fused_sdp_choice(q.unsqueeze(2), keys, values, enable_gqa=True)).name


def attention_from_positions(q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
    """:func:`attention`, capturable: each row's write slot and live length come from
    ``meta.positions``, a device tensor, read by a Triton split-K kernel that also writes
    the cache (:mod:`benchmarks.decode_attention` says why this kernel: it was the fastest
    capturable attention measured, faster than the eager one with its length frozen)."""
    return split_k_decode(q, k, v, k_cache, v_cache, meta.positions[: q.shape[0]])


# The break of breakable graphs; in full graphs (breaks="inline") its capturable variant.
attention_break = bg.eager_on_graph(attention, inline=attention_from_positions)

