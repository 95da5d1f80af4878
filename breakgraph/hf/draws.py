"""Where a Generator's sampled tokens are drawn from: its own generator, standing in for the call's.

A graph draws from the generators it was captured with, whatever generator
the call names, so the sampling graphs are captured with one of the
Generator's own (:class:`Draws`), which starts each call from the state of
the generator the call draws from and hands the advanced state back.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from breakgraph.serving.rank_group import RankGroup


def default_generator(device: torch.device) -> torch.Generator:
    """The generator torch draws from on ``device`` where none is given (``torch.manual_seed`` seeds it)."""
    return torch.cuda.default_generators[device.index] if device.type == "cuda" else torch.default_generator


def require_generator_on(device: torch.device, generator: Any) -> None:
    """Refuse a ``generator`` a draw on ``device`` cannot use (None: the default one, always fine)."""
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    where = generator.device
    if where.type != device.type or where.index not in (None, device.index):
        raise ValueError(
            f"generator is on {where}, but the model is on {device}, where the tokens are drawn: "
            f"pass one made there, torch.Generator({str(device)!r})"
        )


class Draws:
    """The Generator's own generator, which the sampling graphs draw from."""

    def __init__(self, device: torch.device):
        self.device = device
        self.generator = torch.Generator(device=device)

    @property
    def captured_with(self) -> tuple[torch.Generator, ...]:
        """The sampling runner's ``generators``: only a CUDA graph holds one."""
        return (self.generator,) if self.device.type == "cuda" else ()

    @contextlib.contextmanager
    def drawing_from(self, generator: torch.Generator | None, ranks: RankGroup | None, keep_own_state: bool) -> Iterator[None]:
        """Draw from ``generator`` (None: the device's default) for the body's length: start from its
        state and hand the advanced state back, as if it had drawn. With ``ranks``, every rank draws
        rank 0's numbers: tokens that differ would part the ranks. ``keep_own_state``: go on from
        this generator's own state afterwards, as though the body had not drawn."""
        kept = self.generator.get_state() if keep_own_state else None
        if generator is None:
            generator = default_generator(self.device)
        state = generator.get_state()
        if ranks is not None:
            ranks.broadcast(state)
        self.generator.set_state(state)
        try:
            yield
        finally:
            generator.set_state(self.generator.get_state())
            if kept is not None:
                self.generator.set_state(kept)

    def continue_from_default(self) -> None:
        """Take the default generator's state, to draw on from it in its place."""
        self.generator.set_state(default_generator(self.device).get_state())

    def hand_back_to_default(self) -> None:
        """Give the default generator the state the draws made in its place reached."""
        default_generator(self.device).set_state(self.generator.get_state())
