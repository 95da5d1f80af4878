"""The replay plan: a captured graph's steps written out as one Python function per stream.

A small step (a decode step, a small training step) is bound by the host:
each Python call that replay makes delays the GPU by as much, before a
launch and between a break and the next launch. So replay does not loop over
step objects; the plan writes its steps out as the body of one function, once
per stream, with every handle bound, as ``dataclasses`` and ``torch.fx``
generate theirs. A graph launch is one C-level call and a status check; a
break is its function called on its capture-time arguments, then its result
written back, or, when the result holds no buffers (None, a number),
checked by its type in line.

Python (breaks, hooks, debug mode's checks) runs with autograd off, as
capture-time results are written into captured buffers. The plan turns it off
just before the first of them, so the launches ahead do not wait for it, and
from there sets the caller's mode back as the replay ends, raising or not.
"""

from __future__ import annotations

import functools
import linecache
import weakref
from typing import Any, Callable, Sequence

import torch

import breakgraph_bindings as bindings
from breakgraph_bindings import CudaError
from breakgraph import debug as debug_mode
from breakgraph.segments import Segment, TorchGraphSegment


class ReplayPlan:
    """What one replay runs, in order: the ``before`` hook, every segment, the ``after`` hook.

    ``by_stream`` maps a raw stream (``cudaStream_t`` as an int) to the replay
    function :meth:`compile` wrote for it; replay looks its stream up there.
    In ``debug`` mode every step is debug mode's checked launcher
    (:func:`breakgraph.debug.checked`), ``check_finite()`` saying at each
    replay whether break outputs are checked for NaN and Inf.
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
        self.by_stream: dict[int, Callable[[], None]] = {}

    def compile(self, raw_stream: int) -> Callable[[], None]:
        """Write the replay function for ``raw_stream``, keep it in ``by_stream`` and return it.
        Its source is registered with ``linecache`` as long as the plan lives, so a traceback
        through it shows its lines."""
        source, namespace = _Source(self, bindings.stream_handle(raw_stream)).write()
        filename = f"<breakgraph replay {id(self):#x} on stream {raw_stream:#x}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        weakref.finalize(self, linecache.cache.pop, filename, None)
        exec(compile(source, filename, "exec"), namespace)
        # Taken out of the namespace it runs in: left there, the function and its namespace
        # would hold each other, and a dropped graph's memory would wait for the garbage collector.
        replay = self.by_stream[raw_stream] = namespace.pop("replay")
        return replay


class _Source:
    """The source of one plan's replay function on one stream, and the names it binds."""

    def __init__(self, plan: ReplayPlan, stream):
        self.plan, self.stream = plan, stream
        self.namespace: dict[str, Any] = {
            "is_grad_enabled": torch.is_grad_enabled,
            "set_grad_enabled": torch._C._set_grad_enabled,
            # not a method of the plan, which holds the function: no cycle (see compile)
            "launch_failed": functools.partial(_launch_failed, plan.segments),
        }
        self.launches_ahead: list[str] = []  # the lines ahead of the first Python step
        self.lines = self.launches_ahead
        self.autograd_off = False

    def write(self) -> tuple[str, dict]:
        plan = self.plan
        if plan.before is not None:
            self.python(f"{self.bind('before', plan.before)}()")
        if plan.debug:
            launchers = [segment.launcher() for segment in plan.segments]
            for index, step in enumerate(debug_mode.checked(plan.segments, launchers, plan.check_finite)):
                self.python(f"{self.bind(f'checked_{index}', functools.partial(step, self.stream))}()")
        else:
            for index, segment in enumerate(plan.segments):
                self.segment(index, segment)
        if plan.after is not None:
            self.python(f"{self.bind('after', plan.after)}()")
        body = self.launches_ahead
        if self.autograd_off:
            body += ["grad_enabled = is_grad_enabled()", "set_grad_enabled(False)", "try:", *_indent(self.lines)]
            body += ["finally:", "    set_grad_enabled(grad_enabled)"]
        source = "def replay():\n" + "".join(f"{line}\n" for line in _indent(body or ["pass"]))
        return source, self.namespace

    def bind(self, name: str, value: Any) -> str:
        self.namespace[name] = value
        return name

    def python(self, *lines: str) -> None:
        """Lines that run Python: autograd goes off before the first of them."""
        if not self.autograd_off:
            self.lines, self.autograd_off = [], True
        self.lines.extend(lines)

    def segment(self, index: int, segment: Segment) -> None:
        """The lines of ``plan.segments[index]``."""
        if segment.kind == "eager":
            self.eager_break(index, segment)
        elif isinstance(segment, TorchGraphSegment):  # torch launches on the current stream, this one
            self.lines.append(f"{self.bind(f'replay_{index}', segment.capture.replay)}()")
        else:
            launch = self.bind(f"launch_{index}", functools.partial(segment.launcher(), self.stream))
            self.lines += [f"status = {launch}()", "if status[0]:", f"    launch_failed({index}, status[0])"]

    def eager_break(self, index: int, segment) -> None:
        write = segment.write
        arguments = f"*{self.bind(f'args_{index}', segment.args)}"
        if segment.kwargs:
            arguments += f", **{self.bind(f'kwargs_{index}', segment.kwargs)}"
        call = f"{self.bind(f'function_{index}', segment.function)}({arguments})"
        writer = self.bind(f"write_{index}", write)
        if write.result_type is None:
            self.python(f"{self.bind(f'segment_{index}', segment)}.bytes_written = {writer}({call})")
        else:  # nothing to write: the writer only raises, where the type is not the captured one
            expected = self.bind(f"result_type_{index}", write.result_type)
            self.python(f"result = {call}", f"if type(result) is not {expected}:", f"    {writer}(result)")


def _launch_failed(segments: Sequence[Segment], index: int, error) -> None:
    """Raise the failed launch of ``segments[index]`` as a :class:`CudaError` that names it."""
    bindings.clear_last_error()
    raise CudaError(error, "cudaGraphLaunch", debug_mode.describe(segments[index]))


def _indent(lines: list[str]) -> list[str]:
    return [f"    {line}" for line in lines]
