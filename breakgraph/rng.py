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
on the capture stream while no segment records there, arming every
generator registered with it, and its CUDA capture is ended at once, so no
capture stays open while breaks run (a device-wide synchronize in a break
stays legal). The segments, captured through cuda.bindings, draw from the
armed generators. Between segments each generator points at a plain copy
of its state, so eager breaks draw eagerly. After the last segment a
capture is reopened on the capture stream for the keeper to end: that
disarms the generators and records the advance, and every replay calls
``keeper.replay()`` before the first segment. The keeper uses no stream of
its own: a second stream from torch's pool of 32 per device can be the
very stream another thread is capturing on.

This needs torch's per-generator capture state (torch 2.11 and earlier,
where ``CUDAGraph.register_generator_state`` exists); from torch 2.12 on only
a capture torch begins itself can arm a generator, so random ops become
eager breaks there (see :func:`armable`). A generator is armed by one
capture at a time, as with ``torch.cuda.graph``: a capture that meets a
random op while another capture holds the generator waits for it.
"""

from __future__ import annotations

import atexit
import re
import threading
import warnings
from typing import Callable, Sequence

import torch

import breakgraph_bindings as bindings
from breakgraph_bindings import CaptureMode
from breakgraph import runtime


def armable(torch_version: str, graph_has_register_generator_state: bool) -> bool:
    """Whether a torch of ``torch_version`` lets a capture it did not begin arm its CUDA
    generators: releases before 2.12 (pre-releases and nightlies of 2.12 already keep
    generator capture state per torch-owned capture) whose ``CUDAGraph`` has
    ``register_generator_state``."""
    major, minor = (int(part) for part in re.match(r"(\d+)\.(\d+)", torch_version).groups())
    return (major, minor) < (2, 12) and graph_has_register_generator_state


def cooperative() -> bool:
    """Whether this torch's CUDA generators can be armed for captures made through cuda.bindings."""
    return armable(torch.__version__, hasattr(torch.cuda.CUDAGraph, "register_generator_state"))


class GeneratorBusy(RuntimeError):
    """A generator this capture would arm is armed by another capture."""


_armed_changed = threading.Condition(threading.Lock())
_armed: dict[int, torch.Generator] = {}


def _claim(generators: Sequence[torch.Generator], wait: float) -> None:
    """Mark ``generators`` armed by the caller, waiting up to ``wait`` seconds for another
    capture to release them."""
    with _armed_changed:
        free = _armed_changed.wait_for(lambda: not any(id(gen) in _armed for gen in generators), timeout=wait)
        if not free:
            busy = next(gen for gen in generators if id(gen) in _armed)
            waited = f" (waited {wait:g} s for it)" if wait else ""
            raise GeneratorBusy(f"the CUDA generator of {busy.device} is armed by another capture{waited}")
        for gen in generators:
            _armed[id(gen)] = gen


def _require_idle(stream: torch.cuda.Stream) -> None:
    """Refuse to arm on a stream something is capturing on: torch would leave the
    generators and its pool routing half-armed when its capture fails to begin."""
    if bindings.capture_status(stream) is not bindings.CaptureStatus.NONE:
        raise RuntimeError(
            f"cannot arm the CUDA generators on stream {stream.cuda_stream:#x}: a capture is already under way "
            "on it. Give each concurrent capture a stream of its own (streams from torch's pool of 32 per "
            "device are handed out again, so keep each capture's stream alive while it captures)."
        )


_registered: dict[int, torch.cuda.CUDAGraph] = {}  # device index -> a graph that only registers
atexit.register(_registered.clear)  # let go while CUDA is certainly still up


def _keep_device_state(device: torch.device) -> None:
    """Keep the default generator's graph-safe device state (a seed and an offset tensor)
    allocated between captures. torch frees it when no graph is registered with the
    generator and allocates it at the next registration, so every capture would pay an
    allocation, a cudaMalloc once the allocator's cache was emptied; a graph that registers and never captures keeps it, as any live torch graph does."""
    if device.index not in _registered:
        anchor = torch.cuda.CUDAGraph()
        anchor.register_generator_state(torch.cuda.default_generators[device.index])
        _registered.setdefault(device.index, anchor)


def _release(generators: Sequence[torch.Generator]) -> None:
    with _armed_changed:
        for gen in generators:
            _armed.pop(id(gen), None)
        _armed_changed.notify_all()


class ArmedGenerators:
    """The generators one capture has armed: ``device``'s default generator and ``extra`` ones.

    ``stream`` is the capture stream, where the keeper captures; no segment
    may be recording on it while the generators are armed or disarmed.
    ``wait`` is how long to wait for another capture to release the
    generators before raising :class:`GeneratorBusy`.
    """

    def __init__(self, device: torch.device, extra: Sequence[torch.Generator], stream: torch.cuda.Stream, wait: float = 0.0):
        default = torch.cuda.default_generators[device.index]
        self.generators = [default] + [gen for gen in extra if gen is not default]
        for gen in self.generators:  # a generator made with device="cuda" reports no index
            if gen.device.type != "cuda" or gen.device.index not in (None, device.index):
                raise ValueError(f"generators must be CUDA generators of {device}, got one of {gen.device}")
        _require_idle(stream)
        _claim(self.generators, wait)
        self._stream = stream
        try:
            _keep_device_state(device)
            self._plain = [gen.clone_state() for gen in self.generators]
            # keep_graph: ending the keeper instantiates nothing; only a keeper that is
            # replayed (its capture drew random numbers) instantiates, at its first replay.
            with runtime.on_stream(stream):
                self._keeper = torch.cuda.CUDAGraph(keep_graph=True)
                for gen in self.generators[1:]:
                    self._keeper.register_generator_state(gen)
                self._keeper.capture_begin(capture_error_mode="relaxed")  # arms every registered generator
            bindings.end_capture(stream).destroy()  # ...and leaves no capture open
        except BaseException:
            _release(self.generators)
            raise
        self._armed = [gen.graphsafe_get_state() for gen in self.generators]
        self.point_at_plain_states()

    @classmethod
    def off_thread(cls, device: torch.device, *args, **kwargs) -> "ArmedGenerators":
        """Arm on a helper thread, for a capture already under way: the capturing thread's
        allocations are routed to its graph's pool, and the generators' device state
        (allocated when a generator is first armed) must live outside it."""
        outcome: dict = {}

        def arm() -> None:
            try:
                with torch.cuda.device(device):
                    outcome["armed"] = cls(device, *args, **kwargs)
            except BaseException as error:  # re-raised on the capturing thread
                outcome["error"] = error

        helper = threading.Thread(target=arm, name="breakgraph-arm-generators")
        helper.start()
        helper.join()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["armed"]

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

    def disarm(self, keep: bool) -> Callable[[], None] | None:
        """Disarm the generators (once). With ``keep``, return what refills and advances
        them before each replay; otherwise None."""
        keeper, self._keeper = self._keeper, None
        if keeper is None:
            return None
        for gen, state in zip(self.generators, self._armed):
            gen.graphsafe_set_state(state)
        began = False
        try:
            bindings.begin_capture(self._stream, CaptureMode.RELAXED)  # for the keeper to end
            began = True
            with warnings.catch_warnings(), runtime.on_stream(self._stream):
                warnings.simplefilter("ignore")  # "The CUDA Graph is empty": it is meant to be
                keeper.capture_end()
        except BaseException:
            # Leave no capture of ours open (a capture we did not begin is not ours to end),
            # and leave the generators on their plain states: the armed ones could not be
            # disarmed, and eager draws must work.
            if began:
                bindings.discard_capture(self._stream)
            self.point_at_plain_states()
            raise
        finally:
            _release(self.generators)
        return keeper.replay if keep else None
