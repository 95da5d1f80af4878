"""End tokens: when a row stops, and what fills it after, as transformers' greedy search does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from transformers import GenerationConfig


@dataclass(frozen=True)
class EndTokens:
    """The tokens that end a row (none: rows never end), and the token that pads it after."""

    stops: tuple[int, ...]
    pad: int

    @classmethod
    def resolve(cls, config: GenerationConfig, eos_token_id: int | Sequence[int] | None, pad_token_id: int | None) -> EndTokens:
        """What :meth:`Generator.generate` was given, else the generation config's: end tokens
        ``eos_token_id`` (``()`` for none), padded with ``pad_token_id``, else the first end token."""
        stops = _as_tuple(config.eos_token_id if eos_token_id is None else eos_token_id)
        if pad_token_id is None:
            pad_token_id = config.pad_token_id
        return cls(stops, pad_token_id if pad_token_id is not None else (stops[0] if stops else 0))

    def found(self, tokens: torch.Tensor) -> torch.Tensor:
        """Where ``tokens`` holds an end token."""
        return torch.isin(tokens, torch.tensor(self.stops, device=tokens.device))

    def all_stopped(self, tokens: torch.Tensor) -> bool:
        """Whether every row of ``tokens`` (``(n, new)``) holds an end token: one host read."""
        return bool(self.stops) and bool(self.found(tokens).any(dim=1).all())

    def pad_after_stop(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tokens after each row's first end token replaced by the pad token, and the columns
        after the last row's end dropped, as transformers' greedy search leaves them."""
        if not self.stops:
            return tokens
        stopped = self.found(tokens)
        after = (stopped.cumsum(dim=1) - stopped.long()) > 0  # strictly after the first end token
        tokens = tokens.masked_fill(after, self.pad)
        if bool(stopped.any(dim=1).all()):
            last = int(stopped.long().argmax(dim=1).max())
            tokens = tokens[:, : last + 1]
        return tokens


def _as_tuple(token_ids: int | Sequence[int] | None) -> tuple[int, ...]:
    if token_ids is None:
        return ()
    return (int(token_ids),) if isinstance(token_ids, int) else tuple(int(t) for t in token_ids)
