"""The decode steps a Generator captures, by name, and the model forward they run through its cache.

Each step's graphs are captured apart: the greedy step's, and the sampling
step's two variants (its runner's keys): drawing among the
:data:`~breakgraph.hf.sampling.CANDIDATES` highest scores, where top-k keeps
no more, or over the sorted vocabulary.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from typing import Any, Callable

import torch
from transformers import PreTrainedModel

from breakgraph.hf import tracing
from breakgraph.hf.cache import KVCache
from breakgraph.hf.registration import COMPILED_CACHE, generating_into
from breakgraph.hf.sampling import CANDIDATES, Sampling

GREEDY = "greedy"
AMONG_CANDIDATES, OVER_VOCABULARY = "among candidates", "over the vocabulary"
SAMPLING_VARIANTS = (AMONG_CANDIDATES, OVER_VOCABULARY)
STEPS = (GREEDY, *SAMPLING_VARIANTS)


def step_for(settings: Sampling) -> str:
    """The step that serves a call with these settings."""
    if not settings.do_sample:
        return GREEDY
    return AMONG_CANDIDATES if settings.among_candidates else OVER_VOCABULARY


def weakly_bound(method: Callable) -> Callable:
    """``method``, called through a weak reference to its object: a runner that holds a Generator's
    step this way does not keep the Generator, and with it the cache, alive in a reference cycle."""
    owner = weakref.WeakMethod(method)

    def call(*args, **kwargs):
        return owner()(*args, **kwargs)

    call.__name__, call.__qualname__, call.__doc__ = method.__name__, method.__qualname__, method.__doc__
    call.__signature__ = inspect.signature(method)  # what the runner passes by name
    return call


def candidates(step: str) -> int | None:
    """What :func:`~breakgraph.hf.sampling.sample`'s ``candidates`` is for the sampling variant ``step``."""
    return CANDIDATES if step == AMONG_CANDIDATES else None


class ModelForward:
    """A causal LM's forward through a :class:`KVCache`: the logits of each row's last token.

    The prefill runs the model's own forward; a decode step may run the
    compiled one, which must read no host value: it gets a mask transformers
    passes on as given (breakgraph's attention reads the rows' lengths
    instead) and, where the forward takes them, the cache positions.
    """

    def __init__(self, model: PreTrainedModel, device: torch.device):
        self.model = model
        self.device = device
        parameters = inspect.signature(model.forward).parameters
        # Newer transformers take the cache by ``cache`` and deprecate ``past_key_values``.
        self._cache_keyword = "cache" if "cache" in parameters else "past_key_values"
        # Older transformers take ``cache_position``: without it their forward reads the cache's
        # length on the host to make them, which a compiled forward would guard on, compiling
        # again at every step.
        self._takes_cache_position = "cache_position" in parameters
        self._no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)

    def __call__(
        self,
        cache: KVCache,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        first_row: int = 0,
        compiled: Callable[..., Any] | None = None,
    ) -> torch.Tensor:
        """Logits of ``input_ids`` (``(b, q)``), whose row ``r`` starts at slot ``positions[r]`` of
        ``cache`` row ``first_row + r``; by the ``compiled`` forward or, if None, the model's."""
        batch, length = input_ids.shape
        cache.begin(positions, first_row, length)
        position_ids = cache.position_ids(batch, length)
        inputs = dict(input_ids=input_ids, position_ids=position_ids, use_cache=True, logits_to_keep=1)
        inputs[self._cache_keyword] = cache
        forward = self.model
        if compiled is not None:
            forward = compiled
            inputs |= {COMPILED_CACHE: cache, "attention_mask": self._no_mask}
            if self._takes_cache_position:
                inputs["cache_position"] = position_ids[0]  # what transformers does with them, breakgraph's cache ignores
        # The model's own forward takes its turn with a background compile's traces (see tracing).
        with generating_into(cache), tracing.turns.forward() if compiled is None else contextlib.nullcontext():
            output = forward(**inputs)
        return output.logits[:, -1]

    def prefill(self, cache: KVCache, input_ids: torch.Tensor, prompt_lengths: list[int]) -> torch.Tensor:
        """Run the prompts eagerly into ``cache``'s first rows; the logits of each row's last prompt
        token. A row left-padded to ``prompt_lengths[r]`` runs alone: padding is not the model's input."""
        n, length = input_ids.shape
        if len(set(prompt_lengths)) == 1 and prompt_lengths[0] == length:
            cache.lengths.set(prompt_lengths)
            return self(cache, input_ids, torch.zeros(n, dtype=torch.long, device=self.device))
        rows, zero = [], torch.zeros(1, dtype=torch.long, device=self.device)
        for row, real in enumerate(prompt_lengths):
            cache.lengths.set([real])
            rows.append(self(cache, input_ids[row : row + 1, length - real :], zero, first_row=row))
        return torch.cat(rows)
