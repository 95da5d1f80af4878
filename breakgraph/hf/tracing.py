"""Turns between a background compile's torch.fx traces and the Generators' eager forwards.

While torch.fx traces (``torch.fx.Tracer.trace``: Inductor's pattern passes,
AOTAutograd's ``make_fx``), it patches ``torch.nn.Module.__call__`` and the
traced code's globals for the whole process. A model run on another thread
meanwhile goes into the tracer and fails (``NameError: module is not
installed as a submodule``). So while a background compile runs, each of its
traces and each eager forward of the serving thread takes :data:`turn` first:
a prefill waits for the trace under way, and a trace for the prefill.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

turn = threading.RLock()
"""Held by a trace while a background compile runs, and by every eager forward of a Generator."""

TURN_WAIT_S = 60.0
"""How long a trace waits for its turn before it fails its compile. An eager forward that runs
``torch.compile``'d code holds the turn while it waits for Dynamo's compile lock, which the
background compile holds while it traces: without a limit, each would wait for the other."""

_patching = threading.Lock()
_compiles_running = 0
_untaken_trace = None  # torch.fx.Tracer.trace as it was before the first compile that runs now
_trace_in_turn = None  # what replaced it


@contextlib.contextmanager
def traces_take_turns():
    """While held (by any number of background compiles), every torch.fx trace takes :data:`turn`;
    torch's own method is put back as the last one ends, unless something replaced it meanwhile."""
    global _compiles_running, _untaken_trace, _trace_in_turn
    with _patching:
        if _compiles_running == 0:
            _dynamo_wraps_trace_first()
            _untaken_trace = torch.fx.Tracer.trace
            _trace_in_turn = torch.fx.Tracer.trace = _taking_turns(_untaken_trace)
        _compiles_running += 1
    try:
        yield
    finally:
        with _patching:
            _compiles_running -= 1
            if _compiles_running == 0 and torch.fx.Tracer.trace is _trace_in_turn:
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
        if not turn.acquire(timeout=TURN_WAIT_S):
            raise RuntimeError(
                f"breakgraph: a torch.fx trace of a background compile waited {TURN_WAIT_S:g} s for a Generator's "
                "eager forward, which may itself wait for this compile (torch.compile'd code inside the model): "
                "the compile gives up. Compile such a model up front (compile_in_background=False)."
            )
        try:
            return trace(self, *args, **kwargs)
        finally:
            turn.release()

    return trace_in_turn
