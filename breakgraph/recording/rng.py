"""Random ops inside graph segments: the segments that draw are captured by torch.

A random op on a CUDA generator draws graph-safe numbers only inside a capture
that torch itself began (torch's Note [CUDA Graph-safe RNG states]): the
captured kernel reads its seed and offset from device tensors, and only
``torch.cuda.CUDAGraph.replay`` refills them and advances the generator
before it launches. torch 2.12 and later keep that state per CUDA capture and
know only the captures they begin; torch 2.8 to 2.11 keep it per generator.
What works on all of them: the segment that meets a random op is captured by
a ``torch.cuda.CUDAGraph`` into the graph's pool and replayed by it
(:class:`TorchCapture`), while the segments that draw nothing stay on
cuda.bindings.

Two rules make that safe:

- A generator serves one torch capture at a time (torch 2.11 and earlier
  keep one capture state per generator), so a segment claims the generators
  it may draw from until it ends, and a capture that meets a random op while
  another capture's segment holds them waits.
- torch's pinned-memory allocator forgets a pool once every torch graph
  captured into it is gone, and then refuses the next capture into it (an
  internal assert). An empty torch graph captured into each pool at its
  first torch segment keeps the pool known as long as the pool lives.
"""

from __future__ import annotations

import contextlib
import re
import threading
import warnings
import weakref
from typing import Sequence

import torch

import breakgraph_bindings as bindings
from breakgraph.base.runtime import on_stream


def registers_generators_explicitly(torch_version: str) -> bool:
    """Whether a torch of ``torch_version`` needs ``CUDAGraph.register_generator_state``
    for generators other than the default one: releases before 2.14 (torch 2.14
    registers a generator at its first draw in a capture, and warns on the call)."""
    major, minor = (int(part) for part in re.match(r"(\d+)\.(\d+)", torch_version).groups())
    return (major, minor) < (2, 14)


def draw_counts(device: torch.device, extra: Sequence[torch.Generator]) -> tuple[int, ...]:
    """Where ``device``'s default generator and ``extra`` stand: a call that drew random
    numbers from one of them moved it."""
    return tuple(gen.get_offset() for gen in (torch.cuda.default_generators[device.index], *extra))


class GeneratorBusy(RuntimeError):
    """A generator this segment would draw from is held by another capture's segment."""


_held_changed = threading.Condition(threading.Lock())
_held: dict[int, torch.Generator] = {}


def _claim(generators: Sequence[torch.Generator], wait: float) -> None:
    """Mark ``generators`` held by the caller, waiting up to ``wait`` seconds for another
    capture's segment to let them go."""
    with _held_changed:
        free = _held_changed.wait_for(lambda: not any(id(gen) in _held for gen in generators), timeout=wait)
        if not free:
            busy = next(gen for gen in generators if id(gen) in _held)
            waited = f" (waited {wait:g} s for it)" if wait else ""
            raise GeneratorBusy(f"the CUDA generator of {busy.device} is drawn from by another capture{waited}")
        for gen in generators:
            _held[id(gen)] = gen


def _release(generators: Sequence[torch.Generator]) -> None:
    with _held_changed:
        for gen in generators:
            _held.pop(id(gen), None)
        _held_changed.notify_all()


_known_pools: "weakref.WeakKeyDictionary[torch.cuda.MemPool, torch.cuda.CUDAGraph]" = weakref.WeakKeyDictionary()


def _keep_pool_known(pool: torch.cuda.MemPool, stream: bindings.StreamLike) -> None:
    """Capture an empty torch graph into ``pool`` once, and keep it as long as the pool:
    torch's pinned-memory allocator then knows the pool for every later torch capture
    into it. It dies just before the pool does, so the pool still gives its memory back."""
    if pool in _known_pools:
        return
    anchor = torch.cuda.CUDAGraph(keep_graph=True)
    _begin(anchor, pool, "relaxed", stream)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "The CUDA Graph is empty": it is meant to be
        anchor.capture_end()
    _known_pools[pool] = anchor


def _begin(graph: torch.cuda.CUDAGraph, pool: torch.cuda.MemPool, mode: str, stream: bindings.StreamLike) -> None:
    """``graph.capture_begin`` into ``pool`` on ``stream`` (the current stream); if it fails
    half-way, end what it began (its CUDA capture, its routing of allocations to the pool)."""
    try:
        graph.capture_begin(pool=pool.id, capture_error_mode=mode)
    except BaseException:
        bindings.discard_capture(stream)
        _stop_routing_to(pool)
        raise


def _stop_routing_to(pool: torch.cuda.MemPool) -> None:
    """Stop the routing of allocations to ``pool`` that a torch capture began and could not
    end (a pool that dies while allocations are routed aborts the process)."""
    with contextlib.suppress(RuntimeError):  # torch had stopped it: nothing left to stop
        torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), pool.id)


class TorchCapture:
    """One segment captured by ``torch.cuda.CUDAGraph`` on ``stream`` (the capture stream,
    with no capture open on it) into ``pool``: torch arms the generators for it,
    records what it draws, and refills and advances them at each ``replay()``.

    torch begins and ends a capture on the current stream, which may be a side stream
    (a random op, or a break, under ``torch.cuda.stream(side)``): ``stream`` is made
    current for each of those calls.

    ``generators`` are the CUDA generators beside the device's default one that the
    segment may draw from; ``wait`` is how long to wait for another capture's segment
    to let them go before raising :class:`GeneratorBusy`.
    """

    def __init__(
        self, pool: torch.cuda.MemPool, stream: torch.cuda.Stream, mode: str, generators: Sequence[torch.Generator], wait: float
    ):
        device = stream.device
        default = torch.cuda.default_generators[device.index]
        self.generators = [default] + [gen for gen in generators if gen is not default]
        for gen in self.generators:  # a generator made with device="cuda" reports no index
            if gen.device.type != "cuda" or gen.device.index not in (None, device.index):
                raise ValueError(f"generators must be CUDA generators of {device}, got one of {gen.device}")
        self.pool, self.stream = pool, stream
        _claim(self.generators, wait)
        try:
            with on_stream(stream):
                _keep_pool_known(pool, stream)
                self.graph = torch.cuda.CUDAGraph(keep_graph=True)
                if registers_generators_explicitly(torch.__version__):
                    for gen in self.generators[1:]:
                        self.graph.register_generator_state(gen)
                _begin(self.graph, pool, mode, stream)
        except BaseException:
            _release(self.generators)
            raise

    def end(self) -> torch.cuda.CUDAGraph:
        """End the capture; the graph is ready to instantiate and replay. Where ending fails,
        the generators stay claimed until :meth:`abort` lets them go: released here as well,
        a claim another capture made in between would be dropped by the abort."""
        with on_stream(self.stream):
            self.graph.capture_end()
        _release(self.generators)
        return self.graph

    def abort(self) -> None:
        """End the capture after a failure and let the graph go.

        When CUDA invalidated the capture, or refused to end it in :meth:`end` (the
        stream captures nothing then), torch's ``capture_end`` raises before it disarms
        the generators and stops routing allocations to the pool (a pool that dies while
        allocations are routed aborts the process). So torch is given an empty capture on
        the same stream to end instead, and ends its capture as after a success; should
        that fail too, the routing is stopped.
        """
        stream = self.stream
        try:
            with on_stream(stream), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "The CUDA Graph is empty": a failure can come first
                try:
                    self.graph.capture_end()
                except RuntimeError:
                    bindings.discard_capture(stream)
                    try:
                        bindings.begin_capture(stream, bindings.CaptureMode.RELAXED)
                        self.graph.capture_end()
                    except RuntimeError:
                        bindings.discard_capture(stream)
                        _stop_routing_to(self.pool)
        finally:
            _release(self.generators)
            self.graph = None


def borrowed_graph(graph: torch.cuda.CUDAGraph) -> bindings.Graph:
    """``graph``'s captured ``cudaGraph_t``, to count and print; torch keeps owning it."""
    return bindings.Graph.borrowed(graph.raw_cuda_graph())
