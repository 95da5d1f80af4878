"""The benchmarks' model: a Llama-style decoder step, and the ways to run it.

Each layer is RMSNorm, a fused QKV projection, rotary embedding, grouped-query
attention over a KV cache, an output projection and a SwiGLU MLP, in bf16.
Attention (:mod:`benchmarks.attention`) is the part a graph cannot hold: it
reads the cache up to a live length kept in a host-side metadata object that
the engine changes every step (as vLLM's attention metadata), so its shapes
change every step.

Ways to run a step, all on the same weights and cache:

- eager;
- breakgraph: attention is an ``@eager_on_graph`` break;
- :class:`TorchPiecewise`: the same break structure, one ``torch.cuda.CUDAGraph``
  per segment, captured with ``capture_begin``/``capture_end`` and replayed in a
  Python loop (how vLLM, SGLang and Meta's library do it);
- :class:`MetaBreakable`: the same break structure in Meta's library
  (``breakable_cuda_graphs``), attention a ``@no_graph`` function writing into
  an output buffer, as its README says users write a break;
- the lower bound: one ``torch.cuda.graph`` of the whole step with the live
  length frozen at capture (the same kernels, no breaks);
- full graphs: attention's capturable variant, which reads each row's
  position from a device tensor, inside one graph (breakgraph's full mode,
  and a ``torch.cuda.graph`` of the same work).

A :class:`TensorParallel` shards the decoder Megatron-style over several
ranks (:mod:`benchmarks.tensor_parallel`); on one rank, the default, the
decoder is the same model, weight for weight. :mod:`benchmarks.decoder_sizes`
captures it at many batch sizes, as an engine does at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from breakgraph.base.runtime import run_on_stream
from benchmarks.attention import AttentionMetadata, attention


@dataclass(frozen=True)
class DecoderConfig:
    layers: int = 16
    hidden: int = 2048
    heads: int = 16
    kv_heads: int = 4
    intermediate: int = 5632
    kv_capacity: int = 1024
    dtype: torch.dtype = torch.bfloat16

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True)
class TensorParallel:
    """The share of the decoder one rank holds: Megatron-style tensor parallelism over ``world`` ranks.

    The fused QKV and gate-up projections are split by columns (``heads / world``
    query heads, ``kv_heads / world`` key/value heads and ``intermediate / world``
    of the MLP on each rank, each rank attending over its own heads and its own
    KV cache), the output and down projections by rows, their partial results
    summed by an ``all_reduce`` over ``group`` (captured in the graph segments).
    Every rank must be given the same hidden states.

    Arguments:
        rank (int): this rank, within ``group``.
        world (int): the ranks the decoder is split among; 1: the whole decoder, no collective.
        group (torch.distributed.ProcessGroup, optional): the ranks' group; None: the default group.
    """

    rank: int = 0
    world: int = 1
    group: Any = None

    def share(self, total: int, what: str) -> int:
        """This rank's share of ``total`` (heads, key/value heads, MLP columns), which ``world`` must divide."""
        if total % self.world:
            raise ValueError(f"{total} {what} do not split among {self.world} tensor-parallel ranks: choose a world size that divides {total}")
        return total // self.world

    def seed(self, seed: int) -> int:
        """The seed of this rank's shard of the weights: ``seed`` itself on rank 0, and others that
        differ in their low 32 bits (all that the CPU's generator keeps)."""
        return seed + 1_000_003 * self.rank


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(variance + eps)).to(x.dtype) * weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` [batch, heads, head_dim] at per-row angles [batch, 1, head_dim / 2]."""
    first, second = x.float().chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1).to(x.dtype)



class Decoder:
    """Random weights and a KV cache sized for ``max_batch`` rows; with ``tp``, this rank's shard of
    them (made from a seed of ``seed`` and the rank: the ranks' shards are not one model's split)."""

    def __init__(self, config: DecoderConfig, max_batch: int, device="cuda", seed: int = 0, tp: TensorParallel | None = None):
        self.config = c = config
        self.tp = tp = tp or TensorParallel()
        self.heads = tp.share(c.heads, "attention heads")
        self.kv_heads = tp.share(c.kv_heads, "key/value heads")
        self.intermediate = tp.share(c.intermediate, "MLP columns")
        generator = torch.Generator(device=device).manual_seed(tp.seed(seed))

        def weight(*shape):
            return (torch.randn(*shape, device=device, generator=generator) * 0.02).to(c.dtype)

        q, kv = self.heads * c.head_dim, self.kv_heads * c.head_dim
        self.layers = [
            {
                "attn_norm": torch.ones(c.hidden, device=device, dtype=c.dtype),
                "qkv": weight(c.hidden, q + 2 * kv),
                "out": weight(q, c.hidden),
                "mlp_norm": torch.ones(c.hidden, device=device, dtype=c.dtype),
                "gate_up": weight(c.hidden, 2 * self.intermediate),
                "down": weight(self.intermediate, c.hidden),
            }
            for _ in range(c.layers)
        ]
        self.final_norm = torch.ones(c.hidden, device=device, dtype=c.dtype)
        cache_shape = (max_batch, c.kv_capacity, self.kv_heads, c.head_dim)
        self.k_cache = [torch.randn(cache_shape, device=device, generator=generator).to(c.dtype) for _ in range(c.layers)]
        self.v_cache = [torch.randn(cache_shape, device=device, generator=generator).to(c.dtype) for _ in range(c.layers)]
        inverse_frequency = 1.0 / (10000 ** (torch.arange(0, c.head_dim, 2, device=device).float() / c.head_dim))
        angles = torch.outer(torch.arange(c.kv_capacity, device=device).float(), inverse_frequency)
        self.cos, self.sin = angles.cos(), angles.sin()

    def step(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, attend=attention) -> torch.Tensor:
        """One decode step: ``x`` [batch, hidden] hidden states, ``positions`` [batch] int64."""
        c = self.config
        batch = x.shape[0]
        q_width, kv = self.heads * c.head_dim, self.kv_heads * c.head_dim
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        for layer, k_cache, v_cache in zip(self.layers, self.k_cache, self.v_cache):
            h = rms_norm(x, layer["attn_norm"])
            q, k, v = (h @ layer["qkv"]).split([q_width, kv, kv], dim=-1)
            q = rotate(q.view(batch, self.heads, c.head_dim), cos, sin)
            k = rotate(k.view(batch, self.kv_heads, c.head_dim), cos, sin)
            v = v.reshape(batch, self.kv_heads, c.head_dim)
            x = x + self._summed(attend(q, k, v, k_cache[:batch], v_cache[:batch], meta) @ layer["out"])
            gate, up = (rms_norm(x, layer["mlp_norm"]) @ layer["gate_up"]).chunk(2, dim=-1)
            x = x + self._summed((F.silu(gate) * up) @ layer["down"])
        return rms_norm(x, self.final_norm)

    def _summed(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's result: this rank's part, summed over the ranks in place."""
        if self.tp.world > 1:
            dist.all_reduce(partial, group=self.tp.group)
        return partial

    def same_on_every_rank(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` set in place to rank 0's on every rank (nothing on one rank): the row-parallel
        sums add up the ranks' parts of the same rows only if every rank has the same input."""
        if self.tp.world > 1:
            source = dist.get_global_rank(self.tp.group or dist.group.WORLD, 0)
            dist.broadcast(tensor, source, group=self.tp.group)
        return tensor


class TorchPiecewise:
    """The peers' way: one ``torch.cuda.CUDAGraph`` per segment, breaks replayed in a Python loop.

    ``attend`` is what the model calls for attention: at capture it ends the
    current graph, runs attention eagerly, keeps its output buffer, and begins
    the next graph; at replay each break writes its fresh result into that
    buffer, as vLLM's attention writes into a preallocated output.
    """

    def __init__(self, pool):
        self.pool = pool
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.breaks: list = []
        self._graph = None

    def capture(self, fn, stream: torch.cuda.Stream):
        """Capture ``fn(attend)`` on ``stream``; return its output."""
        def capture():
            self._begin()
            output = fn(self.attend)
            self._end()
            return output

        return run_on_stream(stream, capture)

    def _begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self.pool)

    def _end(self) -> None:
        self._graph.capture_end()
        self.graphs.append(self._graph)

    def attend(self, *args):
        self._end()
        output = attention(*args)
        self.breaks.append(lambda: output.copy_(attention(*args)))
        self._begin()
        return output

    def replay(self) -> None:
        for graph, run_break in zip(self.graphs, self.breaks):
            graph.replay()
            run_break()
        self.graphs[-1].replay()


def attention_into(output, *args) -> None:
    """:func:`attention`, writing its result into ``output``: the form of a break in Meta's library,
    whose ``@no_graph`` functions may not return CUDA tensors."""
    output.copy_(attention(*args))


class MetaBreakable:
    """Meta's library's way: one ``breakable_graph`` capture into a ``BreakableCUDAGraph``.

    ``attend`` is what the model calls for attention: it allocates the
    output in the segment being captured (in the graph's pool, so its address
    holds at every replay) and passes it to :func:`attention_into` as a
    ``@no_graph`` function, which ends the segment, runs eagerly and is
    replayed eagerly between the segments.
    """

    def __init__(self, library, pool=None):
        self.graph = library.BreakableCUDAGraph(pool=pool)
        self._library = library
        self._attention_into = library.no_graph(attention_into)

    def capture(self, fn, stream: torch.cuda.Stream):
        """Capture ``fn(attend)`` on ``stream``; return its output."""
        with self._library.breakable_graph(self.graph, stream=stream):
            return fn(self.attend)

    def attend(self, q, *args):
        output = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        self._attention_into(output, q, *args)
        return output

    def replay(self) -> None:
        self.graph.replay()


def assert_matches_eager(got: torch.Tensor, expected: torch.Tensor, what: str) -> float:
    """Fail unless ``got`` is eager's output up to bf16 rounding; return the largest difference.

    The step itself is not deterministic above batch 1: on the H100 two eager
    runs on the same inputs differ by a mean of 0.2% of the values and by up
    to 0.08 in single elements (the GEMMs match exactly, so the attention
    kernel), and
    the 16 layers carry that forward; every graphed variant, torch's too,
    differs from eager by as much. So: every element within 2**-3 of the output's largest value, the mean
    difference within 2**-4 of the mean value, and no NaN (an unwritten,
    poisoned buffer). A stale or misplaced result is off by the values' own size.
    """
    difference = (got.float() - expected.float()).abs()
    scale, mean = expected.float().abs().max().item(), expected.float().abs().mean().item()
    assert torch.isfinite(got).all(), f"{what}: NaN or Inf in the output (a buffer replay did not write)"
    assert difference.max().item() <= scale * 2**-3, f"{what}: max difference {difference.max().item()} of {scale}"
    assert difference.mean().item() <= mean * 2**-4, f"{what}: mean difference {difference.mean().item()} of {mean}"
    return difference.max().item()
