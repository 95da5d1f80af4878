"""Sampling as transformers samples: the settings (:class:`Sampling`) and a draw a graph can hold (:func:`sample`).

:func:`warp` filters the logits as transformers' warpers do, in their order
(``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``), but
reads each row's settings from device tensors rather than from Python
numbers: one captured graph then serves every setting, and changing one
reads nothing back to the host and captures nothing again. :func:`sample`
draws from what is left by the exponential race (``argmax(p / q)`` with
``q ~ Exp(1)`` picks token ``i`` with probability ``p[i]``, as
``torch.multinomial(p, 1)`` does, but with no host sync, so a graph can hold
it and draws afresh at every replay). Where top-k keeps at most
:data:`CANDIDATES` tokens, :func:`sample` may draw among that many highest
scores and leave the vocabulary unsorted.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig

from breakgraph.base.checks import require_bool

# What transformers' generate() takes where neither the call nor the generation config says.
DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0}

CANDIDATES = 256
"""The most tokens top-k may keep for :func:`sample` to draw among the highest-scoring
``CANDIDATES`` only (``torch.topk``), rather than sorting the whole vocabulary: the sort
costs a decode step more than the rest of sampling together."""


@dataclass(frozen=True)
class Sampling:
    """How :meth:`~breakgraph.hf.Generator.generate` picks each new token: the most likely, or drawn.

    The settings are checked when made, and only where they are used: greedy
    decoding ignores the other three, as transformers' does.

    Arguments:
        do_sample (bool, default False): draw each token (True) or take the most likely (False).
        temperature (float, default 1.0): what the logits are divided by before the filters;
            finite and > 0 (below 1 sharper, above 1 flatter).
        top_k (int, default 50): keep the tokens scoring at least the ``top_k``-th highest
            score (ties kept); 0 keeps every token.
        top_p (float, default 1.0): keep the most likely tokens until their probabilities
            reach ``top_p`` (the most likely always kept); in (0, 1], 1 keeps every token.
    """

    do_sample: bool = DEFAULTS["do_sample"]
    temperature: float = DEFAULTS["temperature"]
    top_k: int = DEFAULTS["top_k"]
    top_p: float = DEFAULTS["top_p"]

    def __post_init__(self) -> None:
        require_bool("do_sample", self.do_sample)
        if not self.do_sample:
            return
        temperature, top_k, top_p = self.temperature, self.top_k, self.top_p
        if not _real(temperature) or not math.isfinite(temperature) or temperature <= 0:
            raise ValueError(
                f"temperature must be a finite number > 0, got {temperature!r}: "
                "for greedy decoding pass do_sample=False rather than a temperature of 0"
            )
        if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0:
            raise ValueError(f"top_k must be a whole number >= 0, got {top_k!r}: 0 keeps every token (no top-k filter)")
        if not _real(top_p) or not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}: 1.0 keeps every token (no top-p filter)")
        object.__setattr__(self, "temperature", float(temperature))
        object.__setattr__(self, "top_k", int(top_k))
        object.__setattr__(self, "top_p", float(top_p))

    @classmethod
    def resolve(
        cls,
        generation_config: GenerationConfig,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
    ) -> Sampling:
        """Each setting as given, else as ``generation_config`` says, else transformers' default
        (greedy; temperature 1.0, top_k 50, top_p 1.0), checked.

        Arguments:
            generation_config (GenerationConfig): the model's (``model.generation_config``).
            do_sample, temperature, top_k, top_p (optional): as for :class:`Sampling`; None
                takes the generation config's.
        """
        given = {"do_sample": do_sample, "temperature": temperature, "top_k": top_k, "top_p": top_p}
        for name, value in given.items():
            if value is None:
                configured = getattr(generation_config, name, None)
                given[name] = DEFAULTS[name] if configured is None else configured
        return cls(**given)

    @property
    def among_candidates(self) -> bool:
        """Whether top-k keeps at most :data:`CANDIDATES` tokens, so that :func:`sample` may
        draw among that many highest scores (``candidates=CANDIDATES``)."""
        return 1 <= self.top_k <= CANDIDATES

    def rows(self, n: int, device: torch.device | str) -> dict[str, torch.Tensor]:
        """The settings as :func:`sample` reads them: one value per row, ``n`` rows on ``device``.

        ``top_p`` is held in float64 so that ``1 - top_p`` rounds as transformers' Python float does.

        Arguments:
            n (int): rows.
            device (torch.device or str): where the logits are.
        """
        return {
            "temperature": torch.full((n,), self.temperature, dtype=torch.float32, device=device),
            "top_k": torch.full((n,), self.top_k, dtype=torch.long, device=device),
            "top_p": torch.full((n,), self.top_p, dtype=torch.float64, device=device),
        }


def _real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def warp(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``logits`` as transformers' sampling warpers leave them, row by row: in float32, divided
    by the temperature, -inf where top-k or top-p removes a token.

    One ascending sort serves both filters. Top-k removes what scores below the k-th highest
    score; top-p then removes the tokens whose cumulative probability, from the least likely
    up, is at most ``1 - top_p``, keeping the most likely. The sort is stable, so among
    tokens tied at the top-p cut the higher token ids are kept (transformers' order there
    is its sort's).

    Arguments:
        logits (torch.Tensor): ``(n, vocab)``.
        temperature (torch.Tensor): ``(n,)`` float32, each > 0.
        top_k (torch.Tensor): ``(n,)`` int64, each >= 0 (0: no top-k filter).
        top_p (torch.Tensor): ``(n,)`` float64, each in (0, 1] (1: no top-p filter).
    """
    scores = logits.float() / temperature[:, None]
    ordered, order = scores.sort(dim=-1, stable=True)
    vocab = scores.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    kth_highest = ordered.gather(-1, (vocab - k)[:, None])
    ordered = ordered.masked_fill(ordered < kth_highest, -math.inf)
    cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
    limit = torch.where(top_p < 1, 1 - top_p, -1.0).float()  # rounded to float32 after the subtraction, as transformers'
    removed = cumulative <= limit[:, None]
    removed[:, -1] = False
    ordered = ordered.masked_fill(removed, -math.inf)
    return torch.empty_like(scores).scatter_(-1, order, ordered)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generator: torch.Generator | None = None,
    candidates: int | None = None,
) -> torch.Tensor:
    """One token per row, drawn from the softmax of :func:`warp`'s scores, as transformers'
    ``generate(do_sample=True)`` draws it; no host sync, so a graph can capture it.

    With ``candidates``, the draw is among each row's ``candidates`` highest scores: the
    same distribution where top-k keeps no more than that (every ``top_k`` in 1 to
    ``candidates``), without sorting the vocabulary. Only tokens tied with the k-th highest
    score beyond the candidates would be left out, where transformers keeps every tie.

    Arguments:
        logits (torch.Tensor): ``(n, vocab)``.
        temperature, top_k, top_p (torch.Tensor): ``(n,)`` each, as :meth:`Sampling.rows` makes them.
        generator (torch.Generator, optional): what to draw from; None: the device's default.
        candidates (int, optional): draw among this many highest scores per row.

    Returns the tokens, ``(n,)`` int64.
    """
    tokens = None
    if candidates is not None:
        logits, tokens = logits.topk(min(candidates, logits.shape[-1]), dim=-1)
    probs = warp(logits, temperature, top_k, top_p).softmax(dim=-1)
    race = torch.empty_like(probs).exponential_(generator=generator)
    drawn = probs.div_(race).argmax(dim=-1)
    return drawn if tokens is None else tokens.gather(-1, drawn[:, None]).squeeze(-1)
