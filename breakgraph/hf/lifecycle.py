"""Which of a Generator's steps are captured, and with which forward: the phases of its compile.

A Generator that compiles its decode step captures the compiled forward, and
what it must do before a capture depends on where the compile stands: up
front, the first capture compiles first; in the background, the first capture
is uncompiled, the compile starts once a generation returned, and the first
capture after it ended captures every step again, compiled.
:class:`CaptureLifecycle` holds that one state, :class:`CompilePhase`, and
moves it only by the transitions of ``_MOVES``.
"""

from __future__ import annotations

import contextlib
import enum
import gc
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable, Sequence

import torch

from breakgraph.base import runtime
from breakgraph.hf.compiled import BackgroundCompile, DecodeCompile
from breakgraph.hf.draws import Draws
from breakgraph.serving.rank_group import RankGroup
from breakgraph.serving.runner import GraphRunner


class CompilePhase(enum.Enum):
    """Where a Generator's decode step stands with its compile."""

    UNCOMPILED = "uncompiled"  # compile=False: the model's forward serves
    AHEAD = "to compile ahead"  # compile=True: the first capture compiles first
    WAITING = "waiting for the first capture"  # compile_in_background: the first call serves uncompiled
    DUE = "compile due"  # the first steps are captured uncompiled, or none serve: the compile starts as generate() returns
    RUNNING = "compiling"  # in a thread of its own, the uncompiled steps serving
    SERVING = "compiled"  # the compiled forward serves, and is what the steps capture
    FAILED = "compile failed"  # the background compile raised: the model's forward serves from then on


_MOVES = {
    CompilePhase.AHEAD: (CompilePhase.SERVING,),
    CompilePhase.WAITING: (CompilePhase.DUE,),
    CompilePhase.DUE: (CompilePhase.RUNNING,),
    CompilePhase.RUNNING: (CompilePhase.SERVING, CompilePhase.FAILED),
}


@dataclass
class RunningCompile:
    """A background compile under way, and whether a call drew in the default generator's place meanwhile."""

    work: BackgroundCompile
    drew: bool = False


class CaptureLifecycle:
    """The steps captured so far and the phase of the compile, moved by named transitions.

    * :meth:`capture` captures steps: in ``AHEAD`` it compiles first (where the
      runners capture) and moves to ``SERVING``, captures or not; in ``WAITING``
      it captures uncompiled, or finds no size that serves the call, and moves
      to ``DUE``; in ``RUNNING`` it takes the compile first, waiting for it
      where a step is still to capture (CUDA refuses another thread's
      allocations while one captures).
    * :meth:`start`: ``DUE`` to ``RUNNING``.
    * :meth:`take`: ``RUNNING`` to ``SERVING``, capturing the captured steps
      again, compiled; or to ``FAILED``, where the compiled forward is dropped.

    Arguments:
        runners (sequence of (GraphRunner, step names)): each runner and the steps it captures;
            a runner with keys captures a step under its name as the key.
        draws (Draws): the generator the sampling graphs draw from.
        compile (DecodeCompile, optional): the compiled forward; None: the model's serves.
        in_background (bool): compile in a thread of its own after the first capture.
    """

    def __init__(
        self, runners: Iterable[tuple[GraphRunner, Sequence[str]]], draws: Draws, compile: DecodeCompile | None, in_background: bool,
    ):
        self._runners = [(runner, frozenset(steps)) for runner, steps in runners]
        self._runner_of = {step: runner for runner, steps in self._runners for step in steps}
        self._draws = draws
        self.compile = compile
        if compile is None:
            self.phase = CompilePhase.UNCOMPILED
        else:
            self.phase = CompilePhase.WAITING if in_background else CompilePhase.AHEAD
        self._sizes_captured: set[tuple[str, int]] = set()
        self.running: RunningCompile | None = None
        # Without a GPU the runners capture nothing: nothing to compile for a capture, nor to capture again.
        self._runs_eagerly = any(runner.eager_reason is not None for runner, _ in self._runners)

    @property
    def captured(self) -> set[str]:
        """The steps captured at some size."""
        return {step for step, _size in self._sizes_captured}

    @property
    def compiled_forward(self) -> Callable[..., Any] | None:
        """The compiled forward where it serves the decode step now, else None (the model's serves)."""
        return self.compile.forward if self.phase in (CompilePhase.AHEAD, CompilePhase.SERVING) else None

    @property
    def compiling(self) -> bool:
        """Whether a background compile is due or under way."""
        return self.phase in (CompilePhase.DUE, CompilePhase.RUNNING)

    def _enter(self, phase: CompilePhase) -> None:
        """Move to ``phase``, if ``_MOVES`` allows it from the phase now."""
        allowed = _MOVES.get(self.phase, ())
        if phase not in allowed:
            raise RuntimeError(
                f"breakgraph: the decode step's compile cannot go from {self.phase.value!r} to {phase.value!r} "
                f"(from there only to {[move.value for move in allowed]}): leave its moves to the Generator's "
                "generate(), capture() and wait_for_compile()"
            )
        self.phase = phase

    def capture(self, steps: Iterable[str], rows: int | None = None, wait: bool = True) -> bool:
        """Capture the steps named at the batch size that serves ``rows`` rows (None: at every
        size), where not captured yet, taking an ended background compile first. A compile
        still running is waited for (CUDA refuses its thread's allocations while this one
        captures), unless ``wait`` is False: then nothing is captured, and False returned.
        True: the steps' graphs serve ``rows`` rows; False: the call serves its steps eagerly
        (also where ``rows`` is above every captured size)."""
        if self.phase is CompilePhase.RUNNING and self.running.work.finished:
            self.take()
        if self.phase is CompilePhase.AHEAD:  # also for a first call that no size serves: it runs the compiled forward
            if not self._runs_eagerly:
                self.compile.ahead()
            self._enter(CompilePhase.SERVING)
        serving = {step: self._sizes_serving(step, rows) for step in steps}
        missing = []
        for step, sizes in serving.items():
            uncaptured = [size for size in sizes if (step, size) not in self._sizes_captured]
            if uncaptured:
                missing.append((step, uncaptured))
        # A runner its user released captures again on their restore(), not here.
        if not all(serving.values()) or any(self._runner_of[step].released for step, _sizes in missing):
            if self.phase is CompilePhase.WAITING:  # no capture comes first: the compile is due all the same
                self._enter(CompilePhase.DUE)
            return False
        if self.phase is CompilePhase.RUNNING and wait:  # also with nothing missing: the caller waits to serve compiled
            self.take()
        elif not missing:
            return True
        elif self.phase is CompilePhase.RUNNING:
            return False
        for step, sizes in missing:
            runner = self._runner_of[step]
            with torch.inference_mode():
                runner.capture(keys=[step] if step in runner.keys else None, sizes=sizes)  # a runner without keys serves one step
            self._sizes_captured.update((step, size) for size in sizes)
        if self.phase is CompilePhase.WAITING:
            self._enter(CompilePhase.DUE)
        return True

    def _sizes_serving(self, step: str, rows: int | None) -> list[int]:
        """The sizes of ``step`` that serve ``rows`` rows: the smallest that fits, none where none
        does; every size for None."""
        runner = self._runner_of[step]
        key = step if step in runner.keys else None
        if rows is None:
            return runner.sizes_by_key[key]
        chosen = runner.select(rows, [key])
        return [] if chosen is None else [chosen[1]]

    def start(self) -> None:
        """Start the compile that is due, in a thread of its own. Dynamo sets the default generators
        back to their state at a compile's start as the compile ends: while it runs, draws from the
        default generator go on from the Draws' state (see :meth:`drawing_from`)."""
        self._enter(CompilePhase.RUNNING)
        self._draws.continue_from_default()
        self.running = RunningCompile(BackgroundCompile(self.compile.on_a_twin))

    def take(self, raise_error: bool = False) -> None:
        """Wait for the running compile to end, and serve the compiled step from now on: capture the
        steps captured so far again, compiled. A failed compile leaves the step uncompiled, and is
        raised with ``raise_error``, else warned of (a generation that serves is not the place to fail
        for it)."""
        if self.phase is not CompilePhase.RUNNING:
            raise RuntimeError(
                f"breakgraph: no background compile runs to take (the decode step's compile is {self.phase.value!r}): "
                "call the Generator's wait_for_compile(), which takes one only where it runs"
            )
        error = self.running.work.error()  # waits for the thread
        if self.running.drew:
            self._draws.hand_back_to_default()
        self.running = None
        gc.collect()  # the twin cache and its inputs, which the compile's own objects hold in reference cycles
        if self._draws.device.type == "cuda":
            torch.cuda.empty_cache()  # their blocks, cached for the compile's stream, for the captures to come
        if error is not None:
            self._enter(CompilePhase.FAILED)
            self.compile = None
            message = "compiling the decode step in the background failed; the Generator goes on uncompiled"
            if raise_error:
                raise RuntimeError(message) from error
            runtime.warn_user(f"breakgraph: {message}: {error!r}")
            return
        self._enter(CompilePhase.SERVING)
        if not self._runs_eagerly:
            self._capture_again()

    def _capture_again(self) -> None:
        """Capture again, now compiled, every size of every runner that captured a step."""
        for runner, steps in self._runners:
            if self.captured & steps and not runner.released:  # a runner released by its user captures on restore()
                runner.release()
                with torch.inference_mode():
                    runner.restore()  # the sizes it had captured

    def drawing_from(self, generator: torch.Generator | None, ranks: RankGroup | None) -> ContextManager[None]:
        """A sampling call's draws from ``generator`` (None: the default one), through the Draws.

        While a compile runs, a call that draws from the default generator draws on from the Draws'
        own state, which the default generator takes as the compile is taken; one that names a
        generator leaves the Draws' state where it was."""
        if generator is None and self.running is not None:
            self.running.drew = True
            return contextlib.nullcontext()
        return self._draws.drawing_from(generator, ranks, keep_own_state=self.running is not None)
