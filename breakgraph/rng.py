"""Random ops inside graph segments: torch's CUDA generators armed for raw captures.

torch's philox generators draw graph-safe numbers while they are *armed*
(torch's Note [CUDA Graph-safe RNG states]): a captured kernel reads its
seed and base offset from two device tensors and adds its own offset within
the capture; each replay first refills those tensors from the generator and
advances the generator by what the capture consumed. Only
``torch.cuda.CUDAGraph`` arms a generator (``capture_begin``), records the
advance and disarms it (``capture_end``), and refills it (``replay``).

So a breakable capture arms its generators with a ``torch.cuda.CUDAGraph`` of
its own, the *keeper*, which captures nothing: it is begun in relaxed mode
on a side stream, arming every generator registered with it, and its CUDA
capture is ended at once, so no capture stays open while breaks run (a
device-wide synchronize in a break stays legal). The segments, captured
through cuda.bindings, draw from the armed generators. Between segments
each generator points at a plain copy of its state, so eager breaks draw
eagerly. At the end a capture is reopened on the side stream for the
keeper to end: that disarms the generators and records the advance, and
every replay calls ``keeper.replay()`` before the first segment.

This needs torch's per-generator capture state (torch 2.11 and earlier,
where ``CUDAGraph.register_generator_state`` exists). A generator is armed
by one capture at a time, as with ``torch.cuda.graph``.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Sequence

import torch

import breakgraph_bindings as bindings
from breakgraph_bindings import CaptureMode
from breakgraph import runtime


def cooperative() -> bool:
    """Whether this torch's CUDA generators can be armed for captures made through cuda.bindings."""
    return torch.torch_version.TorchVersion(torch.__version__) < "2.12" and hasattr(
        torch.cuda.CUDAGraph, "register_generator_state"
    )


class GeneratorBusy(RuntimeError):
    """A generator this capture would arm is armed by another thread's capture."""


_armed_lock = threading.Lock()
_armed: dict[int, torch.Generator] = {}


def _claim(generators: Sequence[torch.Generator]) -> None:
    with _armed_lock:
        busy = [gen for gen in generators if id(gen) in _armed]
        if busy:
            raise GeneratorBusy(
                f"the CUDA generator of {busy[0].device} is armed by another thread's capture; torch's "
                "generator serves one capture at a time"
            )
        for gen in generators:
            _armed[id(gen)] = gen


def _release(generators: Sequence[torch.Generator]) -> None:
    with _armed_lock:
        for gen in generators:
            _armed.pop(id(gen), None)


class ArmedGenerators:
    """The generators one capture has armed: ``device``'s default generator and ``extra`` ones."""

    def __init__(self, device: torch.device, extra: Sequence[torch.Generator] = ()):
        default = torch.cuda.default_generators[device.index]
        self.generators = [default] + [gen for gen in extra if gen is not default]
        for gen in self.generators:  # a generator made with device="cuda" reports no index
            if gen.device.type != "cuda" or gen.device.index not in (None, device.index):
                raise ValueError(f"generators must be CUDA generators of {device}, got one of {gen.device}")
        _claim(self.generators)
        try:
            self._plain = [gen.clone_state() for gen in self.generators]
            self._stream = runtime.side_stream(device, "random numbers")
            # keep_graph: ending the keeper instantiates nothing; only a keeper that is
            # replayed (its capture drew random numbers) instantiates, at its first replay.
            self._keeper = torch.cuda.CUDAGraph(keep_graph=True)
            for gen in self.generators[1:]:
                self._keeper.register_generator_state(gen)
            self._stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self._stream):
                self._keeper.capture_begin(capture_error_mode="relaxed")  # arms every registered generator
            bindings.end_capture(self._stream).destroy()  # ...and leaves no capture open
        except BaseException:
            _release(self.generators)
            raise
        self._armed = [gen.graphsafe_get_state() for gen in self.generators]
        self.point_at_plain_states()

    def point_at_armed_states(self) -> None:
        """While a segment records: random ops are captured and draw fresh numbers at replay."""
        for gen, state in zip(self.generators, self._armed):
            gen.graphsafe_set_state(state)

    def point_at_plain_states(self) -> None:
        """Between segments: eager breaks draw eagerly (from a copy the capture then discards)."""
        for gen, state in zip(self.generators, self._plain):
            gen.graphsafe_set_state(state)

    def drawn(self) -> bool:
        """Whether the segments so far drew random numbers; ask while a segment records."""
        return any(int(gen.get_state()[8:].view(torch.int64)) != 0 for gen in self.generators)

    def disarm(self, keep: bool):
        """Disarm the generators (once). With ``keep``, return the replay step that refills
        and advances them (``launch(stream)``); otherwise None."""
        keeper, self._keeper = self._keeper, None
        if keeper is None:
            return None
        for gen, state in zip(self.generators, self._armed):
            gen.graphsafe_set_state(state)
        try:
            bindings.begin_capture(self._stream, CaptureMode.RELAXED)  # for the keeper to end
            with warnings.catch_warnings(), torch.cuda.stream(self._stream):
                warnings.simplefilter("ignore")  # "The CUDA Graph is empty": it is meant to be
                keeper.capture_end()
        except BaseException:
            # Leave no capture open on the side stream, and leave the generators on their
            # plain states: the armed ones could not be disarmed, and eager draws must work.
            with contextlib.suppress(bindings.CudaError):
                if bindings.capture_status(self._stream) is not bindings.CaptureStatus.NONE:
                    bindings.end_capture(self._stream).destroy()
            self.point_at_plain_states()
            raise
        finally:
            _release(self.generators)
        if not keep:
            return None

        def refill(_stream) -> None:
            keeper.replay()

        return refill
