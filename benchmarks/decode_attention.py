"""Capturable decode attention: a Triton split-K kernel that reads each row's position on the device.

Full graphs need attention that takes each row's live length from a device
tensor, so that one graph serves every step. Measured on an H100 (16 query
heads, 4 KV heads, head_dim 128, bf16, 1024-slot cache; µs per layer inside
a graph of 16 layers; one run of a probe not kept here), against the breakable
decoder's eager attention with its length frozen in a graph (the bound):

============================================  =======  =======  ========
candidate                                     batch 1  batch 8  batch 32
============================================  =======  =======  ========
eager SDPA, length frozen (the bound)         10.7     18.7     32.9
flash varlen, ``seqused_k`` (before)          24.0     41.0     58.7
flex_attention, compiled, per-row blocks      16.2     33.1     41.6
SDPA, cuDNN, whole cache + device mask        23.8*    23.8     37.7
efficient attention varlen, ``seqlen_k``      52.6     52.6     57.8
this kernel, 16 splits, cache write fused     5.7      12.7     31.8
============================================  =======  =======  ========

(* batch 8's figure; flash's ``num_splits`` and paged paths are not exposed
by this torch, cuDNN's ragged path has no ``seqused_k``.) The others lose to
launch count and to scanning the whole cache with few blocks: at batch 1
flash varlen runs 16 programs. This kernel splits each row's cache into 16
chunks, one program per (row, KV head, chunk), each handling the KV head's
4 query heads against its chunk up to the row's position; a second kernel
combines the chunks by their log-sum-exp. The first kernel also writes this
step's keys and values into the cache (the chunk that holds the position
does; the others never read that slot), so a layer's attention is two
launches in all.
"""

from __future__ import annotations

import functools
import math

import torch

SPLITS = 16
LOG2_E = 1.4426950408889634


@functools.cache
def _kernels():
    """Compile-on-first-use kernels (Triton ships with CUDA builds of torch; CPU builds lack it)."""
    import triton
    import triton.language as tl

    @triton.jit
    def split_kernel(
        Q, K_NEW, V_NEW, K_CACHE, V_CACHE, POSITIONS, O_PART, LSE_PART,
        stride_qb, stride_qh, stride_knb, stride_knh, stride_vnb, stride_vnh,
        stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
        qk_scale,
        KV_HEADS: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
        SPLITS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        # One program per (row, KV head, chunk): the KV head's G query heads against the
        # chunk's slots up to the row's position; slot ``position`` comes from k, v.
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b = bh // KV_HEADS
        h = bh % KV_HEADS
        pos = tl.load(POSITIONS + b).to(tl.int32)
        start = split * CHUNK
        end = tl.minimum(pos + 1, start + CHUNK)
        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BLOCK_N)
        g_live = offs_g < G
        q = tl.load(Q + b * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :], mask=g_live[:, None], other=0.0)
        k_new = tl.load(K_NEW + b * stride_knb + h * stride_knh + offs_d)
        v_new = tl.load(V_NEW + b * stride_vnb + h * stride_vnh + offs_d)
        k_base = K_CACHE + b.to(tl.int64) * stride_kcb + h * stride_kch
        v_base = V_CACHE + b.to(tl.int64) * stride_vcb + h * stride_vch
        if (pos >= start) & (pos < start + CHUNK):
            tl.store(k_base + pos * stride_kct + offs_d, k_new)
            tl.store(v_base + pos * stride_vct + offs_d, v_new)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for i in tl.static_range(CHUNK // BLOCK_N):
            t = start + i * BLOCK_N + offs_n
            live = t < end
            from_cache = (t < pos)[:, None]
            is_new = (t == pos)[:, None]
            keys = tl.load(k_base + t[:, None] * stride_kct + offs_d[None, :], mask=from_cache, other=0.0)
            values = tl.load(v_base + t[:, None] * stride_vct + offs_d[None, :], mask=from_cache, other=0.0)
            keys = tl.where(is_new, k_new[None, :], keys)
            values = tl.where(is_new, v_new[None, :], values)
            scores = tl.dot(q, tl.trans(keys)) * qk_scale
            scores = tl.where(live[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(scores - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values)
            m_i = m_new
        nonempty = l_i > 0
        safe_l = tl.where(nonempty, l_i, 1.0)
        row = (bh * SPLITS + split) * G + offs_g
        tl.store(O_PART + row[:, None] * D + offs_d[None, :], acc / safe_l[:, None], mask=g_live[:, None])
        tl.store(LSE_PART + row, tl.where(nonempty, m_i + tl.log2(safe_l), float("-inf")), mask=g_live)

    @triton.jit
    def combine_kernel(O_PART, LSE_PART, OUT, G: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr):
        # One program per (row, query head), weighting the chunks by their sum-exp; chunk 0
        # always holds slot 0, so the max is finite. Program b*H + h is (b*KVH + kvh)*G + g.
        pid = tl.program_id(0)
        bh = pid // G
        g = pid % G
        offs_s = tl.arange(0, SPLITS)
        offs_d = tl.arange(0, D)
        row = (bh * SPLITS + offs_s) * G + g
        lse = tl.load(LSE_PART + row)
        weight = tl.exp2(lse - tl.max(lse, 0))
        parts = tl.load(O_PART + row[:, None] * D + offs_d[None, :])
        out = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
        tl.store(OUT + pid * D + offs_d, out.to(OUT.dtype.element_ty))

    return triton, split_kernel, combine_kernel


def split_k_decode(q, k, v, k_cache, v_cache, positions) -> torch.Tensor:
    """Write ``k``, ``v`` [batch, kv_heads, head_dim] into the caches [batch, capacity,
    kv_heads, head_dim] at ``positions`` [batch] (a device tensor) and attend ``q``
    [batch, heads, head_dim] over each row's slots ``0..position``; returns [batch,
    heads * head_dim]. Capturable: nothing reads the positions on the host."""
    triton, split_kernel, combine_kernel = _kernels()
    batch, heads, head_dim = q.shape
    capacity, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group, chunk = heads // kv_heads, capacity // SPLITS
    block_n = min(chunk, 64)
    if capacity % SPLITS or chunk % block_n or block_n < 16:
        raise ValueError(f"split_k_decode needs a cache capacity that is a multiple of {SPLITS * 16}, got {capacity}")
    o_part = torch.empty((batch * kv_heads, SPLITS, group, head_dim), device=q.device, dtype=torch.float32)
    lse_part = torch.empty((batch * kv_heads, SPLITS, group), device=q.device, dtype=torch.float32)
    out = torch.empty((batch, heads * head_dim), device=q.device, dtype=q.dtype)
    split_kernel[(batch * kv_heads, SPLITS)](
        q, k, v, k_cache, v_cache, positions, o_part, lse_part,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        LOG2_E / math.sqrt(head_dim),
        KV_HEADS=kv_heads, G=group, GP=max(16, triton.next_power_of_2(group)), D=head_dim,
        SPLITS=SPLITS, CHUNK=chunk, BLOCK_N=block_n,
        num_warps=4,
    )
    combine_kernel[(batch * heads,)](o_part, lse_part, out, G=group, D=head_dim, SPLITS=SPLITS, num_warps=2)
    return out
