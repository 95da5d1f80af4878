"""Hugging Face transformers models on breakable CUDA graphs.

Importing this module registers the attention implementation ``"breakgraph"``
with transformers' ``AttentionInterface``. Select it with one line, and a
:class:`Generator` captures the model's decode step once per batch size
with a :class:`~breakgraph.GraphRunner` and generates greedily::

    from breakgraph import hf
    model.set_attn_implementation("breakgraph")
    tokens = hf.Generator(model, max_length=512).generate(input_ids, max_new_tokens=128)

Everything but attention is captured. Attention is an ``@eager_on_graph``
break that reads each row's length on the host and attends over that many
cached tokens only (the breakable mode); its capturable variant, recorded
by ``mode="full"``, reads each row's position from a device tensor and
attends over the whole cache under a mask built on the device. Called
without a :class:`Generator` (``model.generate()``, training), the
implementation is transformers' own SDPA attention, masks included.
"""

from __future__ import annotations

import contextvars
from typing import Sequence

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import breakgraph as bg

ATTENTION = "breakgraph"
STOP_CHECK_STEPS = 16  # generate() reads the end tokens back this often: one host sync each

LLAMA_3_2_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192},
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
)
"""``LlamaConfig(**LLAMA_3_2_1B)``: Llama-3.2-1B's shape, for trying a model of real size with
random weights where no model hub can be reached (examples, benchmarks, tests)."""


class RowLengths:
    """How many cached tokens each row attends to in the forward under way, known on the host.

    The generator sets them before every step. Rows a graph pads a live
    batch with attend as far as the first row: their outputs are dropped.
    """

    def __init__(self) -> None:
        self.ends: list[int] = [1]

    def set(self, ends: Sequence[int]) -> None:
        if not ends:
            raise ValueError("a forward needs at least one row")
        self.ends = list(ends)

    def for_rows(self, rows: int) -> list[int]:
        return (self.ends + [self.ends[0]] * rows)[:rows]


class _StaticRowsLayer(CacheLayerMixin):
    """One layer's keys and values, ``(max_batch_size, kv_heads, max_length, head_dim)``, allocated
    once so that every graph reads and writes them at the same addresses."""

    is_compileable = False

    def __init__(self, cache: "KVCache", shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.cache = cache
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # allocated up front
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the forward's new keys and values at each row's position; return the rows' whole cache."""
        rows, slots = self.cache.write_index(key_states.shape[0], key_states.shape[2])
        self.keys[rows, :, slots] = key_states.transpose(1, 2)
        self.values[rows, :, slots] = value_states.transpose(1, 2)
        first = self.cache.first_row
        return self.keys[first : first + key_states.shape[0]], self.values[first : first + key_states.shape[0]]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.lengths.ends[0], 0

    def get_seq_length(self) -> int:
        return self.cache.lengths.ends[0] - self.cache.query_length

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class KVCache(Cache):
    """A static key/value cache whose rows each keep their own length.

    A forward writes its ``q`` new tokens of row ``r`` at slots
    ``positions[r] .. positions[r] + q - 1`` (``positions`` is a device
    tensor, so a graph replays the write for any lengths), into rows
    ``first_row`` onwards.
    """

    def __init__(self, config, max_batch_size: int, max_length: int, dtype: torch.dtype, device: torch.device):
        text = config.get_text_config(decoder=True)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        shape = (max_batch_size, kv_heads, max_length, head_dim)
        super().__init__(layers=[_StaticRowsLayer(self, shape, dtype, device) for _ in range(text.num_hidden_layers)])
        self.row_capacity = max_batch_size  # (transformers' Cache has a read-only max_batch_size)
        self.token_capacity = max_length
        self.lengths = RowLengths()
        self._row_index = torch.arange(max_batch_size, device=device)
        self._offsets = torch.arange(max_length, device=device)
        self.begin(torch.zeros(max_batch_size, dtype=torch.long, device=device), first_row=0, query_length=1)

    def begin(self, positions: torch.Tensor, first_row: int, query_length: int) -> None:
        """What the next forward writes: ``query_length`` tokens per row, row ``r`` of the
        batch at cache row ``first_row + r`` from slot ``positions[r]``."""
        self.positions, self.first_row, self.query_length = positions, first_row, query_length

    def position_ids(self, batch: int, query_length: int) -> torch.Tensor:
        """``(batch, query_length)``: each token's position, which is also its slot."""
        return self.positions[:batch, None] + self._offsets[:query_length]

    def write_index(self, batch: int, query_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row and slot indices, ``(batch, query_length)`` each, of the tokens a forward writes."""
        rows = self._row_index[self.first_row : self.first_row + batch, None]
        return rows, self.position_ids(batch, query_length)


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


@bg.eager_on_graph
def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, lengths: RowLengths, scaling: float):
    """Attention over each row's cached tokens, as many as ``lengths`` says on the host:
    ``(b, heads, q, d)`` queries, ``(b, kv_heads, max_length, d)`` caches, ``(b, q, heads, d)`` out.
    ``positions`` is not read here: the capturable variant reads lengths from it instead."""
    batch, heads, length, _dim = query.shape
    kv_heads = keys.shape[1]
    ends = lengths.for_rows(batch)
    longest = max(ends)
    keys, values = keys[:, :, :longest], values[:, :, :longest]
    if min(ends) == longest == length:  # every row a prefill from slot 0: plain causal attention
        out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scaling, enable_gqa=kv_heads != heads)
        return out.transpose(1, 2).contiguous()
    if min(ends) == longest and length == 1:  # decode, every row as long: nothing to mask
        visible = None
    else:
        visible = _visible(torch.tensor(ends, device=query.device), length, heads // kv_heads, longest)
    return _grouped_attention(query, keys, values, visible, scaling)


@attend.inline
def attend_in_graph(query, keys, values, positions, lengths, scaling):
    """What full graphs record: every row's lengths from ``positions`` on the device, the whole
    cache attended under a mask."""
    batch, heads, length, _dim = query.shape
    visible = _visible(positions[:batch] + length, length, heads // keys.shape[1], keys.shape[2])
    return _grouped_attention(query, keys, values, visible, scaling)


def _grouped_attention(query, keys, values, visible: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """``(b, heads, q, d)`` queries over ``(b, kv_heads, slots, d)`` caches where ``visible`` (from
    :func:`_visible`; None: every slot) allows, as ``(b, q, heads, d)``."""
    batch, heads, length, dim = query.shape
    out = F.scaled_dot_product_attention(_grouped(query, keys.shape[1]), keys, values, attn_mask=visible, scale=scaling)
    return out.reshape(batch, heads, length, dim).transpose(1, 2).contiguous()


_generating: contextvars.ContextVar["KVCache | None"] = contextvars.ContextVar("breakgraph_hf_cache", default=None)
"""The cache of the Generator whose forward is under way in this context, if any."""

# What a model may ask of attention that the break does not do: refused rather than ignored.
_UNSUPPORTED = {"softcap": "logit soft-capping", "s_aux": "attention sinks"}


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """The ``"breakgraph"`` attention implementation (transformers' attention-function signature)."""
    cache = _generating.get()
    if cache is None:  # not under a Generator: transformers' SDPA attention, as "sdpa" would run it
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if dropout:
        raise ValueError("breakgraph's attention is for inference: put the model in eval mode (model.eval())")
    window = kwargs.get("sliding_window")
    if window is not None and window < cache.token_capacity:
        raise NotImplementedError(
            f"{type(module).__name__} attends through a sliding window of {window} tokens, which breakgraph.hf "
            f"does not apply: give the Generator a max_length of at most {window}, or use a model without one"
        )
    for name, what in _UNSUPPORTED.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"{type(module).__name__} asks attention for {what} ({name}=), which breakgraph.hf does not apply")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return attend(query, key, value, cache.positions, cache.lengths, scale), None


def attention_mask(*args, **kwargs):
    """The ``"breakgraph"`` mask implementation: none under a Generator, whose attention knows each
    row's length (under capture transformers would otherwise build a mask into the graph that
    nothing reads); transformers' SDPA mask otherwise."""
    return None if _generating.get() is not None else sdpa_mask(*args, **kwargs)


AttentionInterface.register(ATTENTION, attention_forward)
AttentionMaskInterface.register(ATTENTION, attention_mask)


class Generator:
    """Greedy generation with a transformers causal LM whose decode step is captured per batch size.

    ``model`` must use breakgraph's attention
    (``model.set_attn_implementation("breakgraph")``). The key/value cache
    holds ``max_batch_size`` rows of ``max_length`` tokens (prompt and
    generated). Prefill runs eagerly; every later token comes from one
    replay of the graph captured for the smallest batch size that fits
    (``capture_sizes``; by default the runner's: 1, 2, 4, 8, then every
    multiple of 8, up to ``max_batch_size``), or eagerly for a batch above
    the largest captured size.
    ``mode`` is the runner's graph mode: "breakable" (attention between
    segments, reading each row's length on the host) or "full" (one graph
    per size, attention over the whole cache under a device mask).
    ``runner`` is the :class:`~breakgraph.GraphRunner` (``report()``,
    ``memory()``, ``release()``; ``measure_memory=True`` has it measure its
    executables' memory); graphs are captured on the first :meth:`generate`,
    or by :meth:`capture`.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        max_length: int,
        max_batch_size: int = 8,
        mode: str = "breakable",
        capture_sizes: Sequence[int] | None = None,
        progress: bool = True,
        debug: bool | None = None,
        measure_memory: bool = False,
    ):
        if not getattr(model, "_supports_attention_backend", False):
            raise ValueError(
                f"{type(model).__name__} does not route its attention through transformers' AttentionInterface, "
                "so breakgraph's attention cannot be selected for it"
            )
        self.model = model
        self._require_breakgraph_attention()
        if model.training:
            raise ValueError("Generator runs inference: put the model in eval mode first (model.eval())")
        parameter = next(model.parameters())
        self.device = parameter.device
        if capture_sizes is not None and max(capture_sizes) > max_batch_size:
            raise ValueError(f"capture_sizes {list(capture_sizes)} go above max_batch_size {max_batch_size}: raise max_batch_size")
        self.cache = KVCache(model.config, max_batch_size, max_length, parameter.dtype, parameter.device)
        static = {
            "input_ids": torch.zeros(max_batch_size, 1, dtype=torch.long, device=self.device),
            "positions": torch.zeros(max_batch_size, dtype=torch.long, device=self.device),
        }
        self.runner = bg.GraphRunner(
            self._decode_step, static, capture_sizes, modes=mode, progress=progress, debug=debug, measure_memory=measure_memory
        )
        self._captured = False

    def _require_breakgraph_attention(self) -> None:
        implementation = self.model.config._attn_implementation
        if implementation != ATTENTION:
            raise ValueError(
                f"the model uses the attention implementation {implementation!r}; select breakgraph's first: "
                f"model.set_attn_implementation({ATTENTION!r})"
            )

    @property
    def max_batch_size(self) -> int:
        return self.cache.row_capacity

    @property
    def max_length(self) -> int:
        return self.cache.token_capacity

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, first_row: int = 0) -> torch.Tensor:
        """Logits of ``input_ids`` (``(b, q)``), whose row ``r`` starts at slot ``positions[r]`` of
        cache row ``first_row + r``."""
        batch, length = input_ids.shape
        cache = self.cache
        cache.begin(positions, first_row, length)
        token = _generating.set(cache)
        try:
            output = self.model(
                input_ids=input_ids,
                position_ids=cache.position_ids(batch, length),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        finally:
            _generating.reset(token)
        return output.logits[:, -1]

    def _decode_step(self, input_ids: torch.Tensor, positions: torch.Tensor):
        logits = self._forward(input_ids, positions)
        return logits, logits.argmax(-1)

    def capture(self) -> "Generator":
        """Capture every batch size now, rather than on the first :meth:`generate`."""
        if not self._captured:
            with torch.inference_mode():
                self.runner.capture()
            self._captured = True
        return self

    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        attention_mask: torch.Tensor | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        return_logits: bool = False,
    ):
        """Greedy tokens after ``input_ids`` (``(n, T)``; left-padded rows with ``attention_mask``, as
        transformers' tokenizers pad for generation): the prompt and up to ``max_new_tokens`` new
        tokens per row, as ``model.generate(do_sample=False)`` returns them.

        End tokens are ``eos_token_id``, by default the model's generation config's (pass ``()``
        for none): a row that produced one is padded with ``pad_token_id`` (by default the
        config's, else the first end token) from then on, and generation stops once every row
        has (checked every ``STOP_CHECK_STEPS`` steps, one host read each). With
        ``return_logits``, also the logits of every new token, ``(n, new, vocab)``.
        """
        self._require_breakgraph_attention()  # another attention would ignore the cache's lengths
        prompt_lengths = self._prompt_lengths(input_ids, attention_mask, max_new_tokens)
        self.capture()  # before the prefill: capturing runs the step, which writes cache slots
        input_ids = input_ids.to(self.device)
        n = input_ids.shape[0]
        config = self.model.generation_config
        stops = _as_tuple(config.eos_token_id if eos_token_id is None else eos_token_id)
        if pad_token_id is None:
            pad_token_id = config.pad_token_id
        pad = pad_token_id if pad_token_id is not None else (stops[0] if stops else 0)
        tokens = torch.empty(n, max_new_tokens, dtype=torch.long, device=self.device)
        logits = [] if return_logits else None
        first = self._prefill(input_ids, prompt_lengths)
        tokens[:, 0] = first.argmax(-1)
        if logits is not None:
            logits.append(first)
        positions = torch.tensor(prompt_lengths, device=self.device)
        done = 1
        for step in range(1, max_new_tokens):
            self.cache.lengths.set([length + step for length in prompt_lengths])
            step_logits, token = self.runner(input_ids=tokens[:, step - 1 : step], positions=positions)
            tokens[:, step] = token
            if logits is not None:
                logits.append(step_logits.clone())
            positions += 1
            done = step + 1
            if stops and done % STOP_CHECK_STEPS == 0 and _all_stopped(tokens[:, :done], stops):
                break
        tokens = tokens[:, :done]
        if stops:
            tokens = _pad_after_stop(tokens, stops, pad)
        out = torch.cat([input_ids, tokens], dim=1)
        return (out, torch.stack(logits[: tokens.shape[1]], dim=1)) if logits is not None else out

    def _prompt_lengths(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, max_new_tokens: int) -> list[int]:
        if input_ids.ndim != 2 or 0 in input_ids.shape:
            raise ValueError(f"input_ids must be (batch, prompt length), with rows and a prompt, got shape {tuple(input_ids.shape)}")
        n, length = input_ids.shape
        if n > self.max_batch_size:
            raise ValueError(f"{n} prompts, but this Generator's cache holds {self.max_batch_size} rows (max_batch_size)")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if length + max_new_tokens > self.max_length:
            raise ValueError(
                f"a {length}-token prompt and {max_new_tokens} new tokens need {length + max_new_tokens} cache slots, "
                f"but this Generator holds {self.max_length} (max_length)"
            )
        if attention_mask is None:
            return [length] * n
        mask = attention_mask.to("cpu", torch.bool)
        lengths = mask.sum(1).tolist()
        for row, real in enumerate(lengths):
            if real == 0 or not bool(mask[row, length - real :].all()):
                raise ValueError(f"row {row} of attention_mask is not left-padded (zeros, then ones, at least one)")
        return lengths

    def _prefill(self, input_ids: torch.Tensor, prompt_lengths: list[int]) -> torch.Tensor:
        """Run the prompts eagerly into the cache; the logits of each row's last prompt token."""
        n, length = input_ids.shape
        if len(set(prompt_lengths)) == 1 and prompt_lengths[0] == length:
            self.cache.lengths.set(prompt_lengths)
            return self._forward(input_ids, torch.zeros(n, dtype=torch.long, device=self.device))
        rows, zero = [], torch.zeros(1, dtype=torch.long, device=self.device)
        for row, real in enumerate(prompt_lengths):  # left padding is not the model's input: one row at a time
            self.cache.lengths.set([real])
            rows.append(self._forward(input_ids[row : row + 1, length - real :], zero, first_row=row))
        return torch.cat(rows)


def _as_tuple(token_ids) -> tuple[int, ...]:
    if token_ids is None:
        return ()
    return (int(token_ids),) if isinstance(token_ids, int) else tuple(int(t) for t in token_ids)


def _end_tokens(tokens: torch.Tensor, stops: tuple[int, ...]) -> torch.Tensor:
    """Where ``tokens`` holds an end token."""
    return torch.isin(tokens, torch.tensor(stops, device=tokens.device))


def _all_stopped(tokens: torch.Tensor, stops: tuple[int, ...]) -> bool:
    return bool(_end_tokens(tokens, stops).any(dim=1).all())


def _pad_after_stop(tokens: torch.Tensor, stops: tuple[int, ...], pad: int) -> torch.Tensor:
    """Tokens after each row's first end token replaced by ``pad``, and the columns after the
    last row's end dropped, as transformers' greedy search leaves them."""
    stopped = _end_tokens(tokens, stops)
    after = (stopped.cumsum(dim=1) - stopped.long()) > 0  # strictly after the first end token
    tokens = tokens.masked_fill(after, pad)
    if bool(stopped.any(dim=1).all()):
        last = int(stopped.long().argmax(dim=1).max())
        tokens = tokens[:, : last + 1]
    return tokens
