"""The Generator's key/value cache: static rows at frozen addresses, each row of its own length."""

from __future__ import annotations

import math
from typing import Sequence

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin

from breakgraph.base.checks import require_count


class RowLengths:
    """How many cached tokens each row attends to in the forward under way, known on the host.

    The generator sets them before every step. Rows a graph pads a live
    batch with attend as far as the first row: their outputs are dropped.
    """

    def __init__(self) -> None:
        self.ends: list[int] = [1]

    def set(self, ends: Sequence[int]) -> None:
        """Arguments:
        ends (sequence of int): for each row of the forward, the cache slots it attends to
            (its tokens so far, the forward's own included).
        """
        if not ends:
            raise ValueError("a forward needs at least one row")
        self.ends = list(ends)

    def for_rows(self, rows: int) -> list[int]:
        """The ends of ``rows`` rows: those set, then the first row's for the rows a graph pads with.

        Arguments:
            rows (int): the forward's rows, padding included.
        """
        return (self.ends + [self.ends[0]] * rows)[:rows]


def decoder_shape(config: PretrainedConfig, tp_size: int = 1) -> tuple[int, int, int]:
    """``(layers, key/value heads, head size)`` of the text decoder that ``config`` describes, the
    key/value heads those of one of ``tp_size`` tensor-parallel ranks (transformers splits each
    attention layer's projections among them); heads that do not split whole are refused."""
    text = config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    # Configs leave out what a model derives: head_dim where it is hidden_size // heads,
    # num_key_value_heads where every head has keys of its own (no grouped-query attention).
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads % tp_size or kv_heads % tp_size:
        common = math.gcd(heads, kv_heads)
        sizes = ", ".join(str(size) for size in range(1, common + 1) if common % size == 0)
        raise ValueError(
            f"the model's {heads} attention heads and {kv_heads} key/value heads do not split evenly among "
            f"{tp_size} tensor-parallel ranks, and breakgraph.hf serves whole heads on every rank: load it "
            f"on a number of ranks that divides both ({sizes})"
        )
    return text.num_hidden_layers, kv_heads // tp_size, head_dim


class ForwardWrites:
    """What the forward under way writes and attends to, shared by a cache and its layers: no layer
    points back at its cache, whose memory then goes as soon as its Generator does (a reference
    cycle would keep it for Python's cycle collector)."""

    def __init__(self, max_batch_size: int, max_length: int, device: torch.device):
        self.lengths = RowLengths()
        self.row_index = torch.arange(max_batch_size, device=device)
        self.offsets = torch.arange(max_length, device=device)
        self.positions = torch.zeros(max_batch_size, dtype=torch.long, device=device)
        self.first_row, self.query_length = 0, 1

    def begin(self, positions: torch.Tensor, first_row: int, query_length: int) -> None:
        """The next forward's: see :meth:`KVCache.begin`."""
        self.positions, self.first_row, self.query_length = positions, first_row, query_length

    def position_ids(self, batch: int, query_length: int) -> torch.Tensor:
        return self.positions[:batch, None] + self.offsets[:query_length]

    def write_index(self, batch: int, query_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.row_index[self.first_row : self.first_row + batch, None]
        return rows, self.position_ids(batch, query_length)


class _StaticRowsLayer(CacheLayerMixin):
    """One layer's keys and values, ``(max_batch_size, kv_heads, max_length, head_dim)`` (the heads
    of this rank), allocated once so that every graph reads and writes them at the same addresses."""

    is_compileable = False

    def __init__(self, writes: ForwardWrites, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.writes = writes
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # allocated up front
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the forward's new keys and values at each row's position; return the rows' whole cache."""
        if key_states.shape[1] != self.keys.shape[1]:  # a shape on the host: no sync, nothing captured
            raise ValueError(
                f"the model's attention gives {key_states.shape[1]} key/value heads, but the cache holds "
                f"{self.keys.shape[1]} per layer: make the cache from the model's config and its tensor-parallel "
                "size (KVCache(..., tp_size=model.tp_size); a Generator does)"
            )
        rows, slots = self.writes.write_index(key_states.shape[0], key_states.shape[2])
        self.keys[rows, :, slots] = key_states.transpose(1, 2)
        self.values[rows, :, slots] = value_states.transpose(1, 2)
        first = self.writes.first_row
        return self.keys[first : first + key_states.shape[0]], self.values[first : first + key_states.shape[0]]

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        # From the host lengths, whatever transformers passes (the query length; older releases, cache positions).
        return self.writes.lengths.ends[0], 0

    def get_seq_length(self) -> int:
        return self.writes.lengths.ends[0] - self.writes.query_length

    def get_max_length(self) -> int:
        return self.keys.shape[2]

    # Older releases of the range (5.0 at least to 5.10) require it of a layer under this name.
    get_max_cache_shape = get_max_length


class KVCache(Cache):
    """A static key/value cache whose rows each keep their own length.

    A forward writes its ``q`` new tokens of row ``r`` at slots
    ``positions[r] .. positions[r] + q - 1`` (``positions`` is a device
    tensor, so a graph replays the write for any lengths), into rows
    ``first_row`` onwards.

    Arguments:
        config (PretrainedConfig): the model's config; its text decoder's layers, key/value
            heads and head size shape the cache.
        max_batch_size (int): rows, one per sequence generated at once.
        max_length (int): slots per row: prompt and generated tokens.
        dtype (torch.dtype): of the keys and values, the model's.
        device (torch.device): where the cache lives, the model's.
        tp_size (int, default 1): the tensor-parallel ranks the model's heads are split among
            (``model.tp_size``): this rank's cache holds its share, ``kv_heads // tp_size``. Heads
            that do not split evenly are refused.
    """

    def __init__(
        self, config: PretrainedConfig, max_batch_size: int, max_length: int, dtype: torch.dtype, device: torch.device,
        tp_size: int = 1,
    ):
        require_count("tp_size", tp_size)
        self._made_with = (config, max_batch_size, max_length, dtype, device, tp_size)
        layers, kv_heads, head_dim = decoder_shape(config, tp_size)
        shape = (max_batch_size, kv_heads, max_length, head_dim)
        self.writes = ForwardWrites(max_batch_size, max_length, device)
        super().__init__(layers=[_StaticRowsLayer(self.writes, shape, dtype, device) for _ in range(layers)])
        self.row_capacity = max_batch_size  # (transformers' Cache has a read-only max_batch_size)
        self.token_capacity = max_length

    def twin(self) -> KVCache:
        """A cache of the same shapes, dtype and device, with memory of its own: a compile in the
        background writes there, and torch.compile's guards on this one's shapes hold for both."""
        return KVCache(*self._made_with)

    def begin(self, positions: torch.Tensor, first_row: int, query_length: int) -> None:
        """Say what the next forward writes.

        Arguments:
            positions (torch.Tensor): ``(batch,)`` long, on the cache's device: the slot of each
                row's first new token.
            first_row (int): the cache row of the batch's row 0.
            query_length (int): new tokens per row.
        """
        self.writes.begin(positions, first_row, query_length)

    @property
    def lengths(self) -> RowLengths:
        """How many cached tokens each row of the forward under way attends to."""
        return self.writes.lengths

    @property
    def positions(self) -> torch.Tensor:
        """``(batch,)``: the slot of each row's first new token in the forward under way."""
        return self.writes.positions

    def position_ids(self, batch: int, query_length: int) -> torch.Tensor:
        """``(batch, query_length)``: each token's position, which is also its slot.

        Arguments:
            batch (int): the forward's rows.
            query_length (int): its new tokens per row.
        """
        return self.writes.position_ids(batch, query_length)

    def write_index(self, batch: int, query_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row and slot indices, ``(batch, query_length)`` each, of the tokens a forward writes.

        Arguments:
            batch (int): the forward's rows.
            query_length (int): its new tokens per row.
        """
        return self.writes.write_index(batch, query_length)
