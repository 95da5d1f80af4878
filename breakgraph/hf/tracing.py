"""Turns between a background compile's torch.fx traces and the Generators' eager forwards.

While torch.fx traces (``torch.fx.Tracer.trace``: Inductor's pattern passes,
AOTAutograd's ``make_fx``), it patches ``torch.nn.Module.__call__`` and the
traced code's globals for the whole process. A model run on another thread
meanwhile goes into the tracer and fails (``NameError: module is not
installed as a submodule``). So while a background compile runs, each of its
traces goes alone (:data:`turns`): a prefill waits for the trace under way, and a
trace for the forwards under way.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
from typing import Iterator

import torch


class Turns:
    """The Generators' eager forwards and the torch.fx traces of background compiles, in turns.

    Each trace goes alone: it waits for the forwards under way, and forwards
    that come while it waits go after it, so a steady stream of prefills
    cannot hold a compile off. While no background compile runs, forwards on
    different threads run side by side. While one runs, they go one thread at
    a time: a forward may trace (its model runs ``torch.compile``'d code), and
    two threads' forwards that each waited to trace would wait for each
    other. A thread may trace inside its own forward, and run a forward inside
    its own trace.
    """

    def __init__(self):
        self._changed = threading.Condition()
        self._compiles = 0  # background compiles running
        self._forwards: collections.Counter[int] = collections.Counter()  # per thread, how deep
        self._tracer: int | None = None
        self._trace_depth = 0
        self._traces_waiting = 0

    def count_compile(self, change: int) -> int:
        """Count a background compile in (+1) or out (-1); how many run now."""
        with self._changed:
            self._compiles += change
            self._changed.notify_all()
            return self._compiles

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Run a forward: after the trace under way or waiting and, while a background compile runs,
        after other threads' forwards; at once where this thread is in a forward or a trace already."""
        me = threading.get_ident()

        def may_go() -> bool:
            if self._tracer == me or me in self._forwards:
                return True
            if self._tracer is not None or self._traces_waiting:
                return False
            return not self._compiles or not self._forwards

        with self._changed:
            self._changed.wait_for(may_go)
            self._forwards[me] += 1
        try:
            yield
        finally:
            with self._changed:
                self._forwards[me] -= 1
                if not self._forwards[me]:
                    del self._forwards[me]
                self._changed.notify_all()

    def begin_trace(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until no other thread traces or runs a forward, then trace;
        False where the wait ran out (nothing is held then)."""
        me = threading.get_ident()
        with self._changed:
            self._traces_waiting += 1
            try:
                alone = self._changed.wait_for(lambda: self._tracer in (None, me) and self._forwards.keys() <= {me}, timeout)
            finally:
                self._traces_waiting -= 1
                self._changed.notify_all()  # forwards held back by this wait may go, if it ran out
            if alone:
                self._tracer, self._trace_depth = me, self._trace_depth + 1
            return alone

    def end_trace(self) -> None:
        with self._changed:
            self._trace_depth -= 1
            if not self._trace_depth:
                self._tracer = None
            self._changed.notify_all()


turns = Turns()
"""What the traces of background compiles and the Generators' eager forwards take."""

TURN_WAIT_S = 60.0
"""How long a trace waits for its turn before it fails its compile. An eager forward that runs
``torch.compile``'d code waits for Dynamo's compile lock, which the background compile holds
while it traces, and the trace for that forward: without a limit, each would wait for the other."""

_patching = threading.Lock()
_untaken_trace = None  # torch.fx.Tracer.trace as it was before the first compile that runs now
_trace_in_turn = None  # what replaced it


@contextlib.contextmanager
def traces_take_turns():
    """While held (by any number of background compiles), every torch.fx trace goes alone (:data:`turns`);
    torch's own method is put back as the last one ends, unless something replaced it meanwhile."""
    global _untaken_trace, _trace_in_turn
    with _patching:
        if turns.count_compile(+1) == 1:
            _dynamo_wraps_trace_first()
            _untaken_trace = torch.fx.Tracer.trace
            _trace_in_turn = torch.fx.Tracer.trace = _taking_turns(_untaken_trace)
    try:
        yield
    finally:
        with _patching:
            if turns.count_compile(-1) == 0 and torch.fx.Tracer.trace is _trace_in_turn:
                torch.fx.Tracer.trace = _untaken_trace


def _dynamo_wraps_trace_first() -> None:
    """Dynamo wraps ``Tracer.trace`` once per process, at the first ``torch.compile``: done before
    the turns are installed, its wrapper is inside theirs, and stays as they are taken off."""
    import torch._dynamo.eval_frame  # the compile imports it anyway

    patcher = getattr(torch._dynamo.eval_frame, "TorchPatcher", None)
    if patcher is not None:
        patcher.patch()


def _taking_turns(trace):
    @functools.wraps(trace, updated=())  # not Dynamo's marks of its own wrapper, which this is not
    def trace_in_turn(self, *args, **kwargs):
        if not turns.begin_trace(TURN_WAIT_S):
            raise RuntimeError(
                f"breakgraph: a torch.fx trace waited {TURN_WAIT_S:g} s for a Generator's eager forward while a "
                "compile runs in the background; the forward may itself wait for this compile (torch.compile'd "
                "code inside the model), so the compile gives up. Compile such a model up front "
                "(compile_in_background=False)."
            )
        try:
            return trace(self, *args, **kwargs)
        finally:
            turns.end_trace()

    return trace_in_turn
