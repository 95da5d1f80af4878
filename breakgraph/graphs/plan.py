"""The replay plan: a captured graph's steps written out as one Python function per stream.

A small step (a decode step, a small training step) is bound by the host:
each Python call that replay makes delays the GPU by as much, before a
launch and between a break and the next launch. So replay does not loop over
step objects; the plan writes its steps out as the body of one function, once
per stream, with every handle bound, as ``dataclasses`` and ``torch.fx``
generate theirs. Each segment writes its own lines (:meth:`Segment.emit
<breakgraph.recording.segments.Segment.emit>`): a graph launch is one C-level call and a
status check; a break is its function called on its capture-time arguments,
then its result written back, or, when the result holds no buffers (None, a
number), checked by its type in line. Debug mode and the profile run the same
lines, each segment's as a function of its own (:meth:`ReplayPlan.step_functions`):
how a segment replays is written in one place.

Python (breaks, hooks, debug mode's checks) runs with autograd off, as
capture-time results are written into captured buffers, and with CUDA
autocast off, as a break replays the dtypes it was captured with whatever the
caller's autocast (one captured under autocast turns its own back on). The
plan turns both off just before the first of them, so the launches ahead do
not wait for it, and from there sets the caller's modes back as the replay
ends, raising or not.
"""

from __future__ import annotations

import linecache
import weakref
from typing import Any, Callable, Sequence

import torch

import breakgraph_bindings as bindings
from breakgraph.graphs import debug as debug_mode
from breakgraph.recording.segments import Segment


class ReplayPlan:
    """What one replay runs, in order: the ``before`` hook, every segment, the ``after`` hook.

    ``by_stream`` maps a raw stream (``cudaStream_t`` as an int) to the replay
    function :meth:`compile` wrote for it; replay looks its stream up there.
    In ``debug`` mode every step is one of :meth:`step_functions`, checked by
    debug mode (:func:`breakgraph.graphs.debug.checked`), ``check_finite()`` saying at
    each replay whether break outputs are checked for NaN and Inf.
    """

    def __init__(
        self,
        segments: Sequence[Segment],
        before: Callable[[], Any] | None = None,
        after: Callable[[], Any] | None = None,
        debug: bool = False,
        check_finite: Callable[[], bool] = lambda: False,
    ):
        self.segments = tuple(segments)
        self.before, self.after = before, after
        self.debug, self.check_finite = debug, check_finite
        self.by_stream: dict[int, debug_mode.Step] = {}

    def compile(self, raw_stream: int) -> debug_mode.Step:
        """Write the replay function for ``raw_stream``, keep it in ``by_stream`` and return it."""
        stream = bindings.stream_handle(raw_stream)
        source = _Source(stream, {})
        if self.before is not None:
            source.python(f"{source.bind('before', self.before)}()")
        if self.debug:
            steps = debug_mode.checked(self.segments, self.step_functions(stream), stream, self.check_finite)
            for index, step in enumerate(steps):
                source.python(f"{source.bind(f'checked_{index}', step)}()")
        else:
            for index, segment in enumerate(self.segments):
                source.write(index, segment)
        if self.after is not None:
            source.python(f"{source.bind('after', self.after)}()")
        what = f"replay {id(self):#x} on stream {raw_stream:#x}"
        replay = self.by_stream[raw_stream] = _define(self, what, {"replay": source.body()}, source.namespace)[0]
        return replay

    def step_functions(self, stream: bindings.StreamLike) -> list[debug_mode.Step]:
        """Each segment's replay on ``stream`` as a function of its own, written from the lines
        the replay function runs, without the plan's hooks and mode switches: debug mode
        checks each step, the profile times each."""
        handle = bindings.stream_handle(stream)
        namespace: dict[str, Any] = {}
        bodies = {}
        for index, segment in enumerate(self.segments):
            source = _Source(handle, namespace)
            source.write(index, segment)
            bodies[f"step_{index}"] = source.body(switch_modes=False)
        return _define(self, f"steps {id(self):#x} on stream {int(handle):#x}", bodies, namespace)


def _define(plan: ReplayPlan, what: str, bodies: dict[str, list[str]], namespace: dict[str, Any]) -> list[debug_mode.Step]:
    """The functions of no arguments that ``bodies`` names, run in ``namespace``. Their source
    is registered with ``linecache`` as long as ``plan`` lives, so a traceback shows its lines."""
    source = "".join(f"def {name}():\n" + "".join(f"{line}\n" for line in _indent(body or ["pass"])) for name, body in bodies.items())
    filename = f"<breakgraph {what}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    weakref.finalize(plan, linecache.cache.pop, filename, None)
    exec(compile(source, filename, "exec"), namespace)
    # Taken out of the namespace they run in: left there, the functions and their namespace
    # would hold each other, and a dropped graph's memory would wait for the garbage collector.
    return [namespace.pop(name) for name in bodies]


class _Source:
    """The body of a function being written, and the names it binds: what segments write
    their replay into (:class:`breakgraph.recording.segments.ReplaySource`). Nothing bound refers back
    to the plan, which holds the function: no cycle (see :func:`_define`)."""

    def __init__(self, stream: bindings.StreamHandle, namespace: dict[str, Any]):
        self.stream = stream
        self.namespace = namespace
        self.suffix = ""  # "_<index>" while segment <index> writes: the names it binds are its own
        self.ahead: list[str] = []  # the lines ahead of the first that runs Python
        self.from_python: list[str] = []  # that line and those after it

    def write(self, index: int, segment: Segment) -> None:
        """The lines of the plan's segment ``index``."""
        self.suffix = f"_{index}"
        try:
            segment.emit(self)
        finally:
            self.suffix = ""

    def bind(self, name: str, value: Any) -> str:
        name += self.suffix
        self.namespace[name] = value
        return name

    def launch(self, *lines: str) -> None:
        (self.from_python or self.ahead).extend(lines)

    def python(self, *lines: str) -> None:
        self.from_python.extend(lines)

    def body(self, switch_modes: bool = True) -> list[str]:
        """The lines; with ``switch_modes``, autograd and CUDA autocast are off from the first
        that runs Python to the end, and the caller's modes come back after it."""
        if not switch_modes or not self.from_python:
            return self.ahead + self.from_python
        self.namespace.update(
            is_grad_enabled=torch.is_grad_enabled,
            set_grad_enabled=torch._C._set_grad_enabled,
            is_autocast_enabled=torch.is_autocast_enabled,
            set_autocast_enabled=torch.set_autocast_enabled,
        )
        turned_off = [
            "grad_enabled = is_grad_enabled()",
            "set_grad_enabled(False)",
            "autocast = is_autocast_enabled('cuda')",
            "if autocast:",
            "    set_autocast_enabled('cuda', False)",
            "try:",
            *_indent(self.from_python),
        ]
        turned_back = ["finally:", "    set_grad_enabled(grad_enabled)", "    set_autocast_enabled('cuda', autocast)"]
        return self.ahead + turned_off + turned_back


def _indent(lines: list[str]) -> list[str]:
    return [f"    {line}" for line in lines]
