"""The Generator's compiled decode step: ``torch.compile`` of the model's forward, captured by breakgraph.

Inductor fuses the model's kernels between attention calls; breakgraph
captures what the compiled code launches into its segments, attention (the
custom op of :mod:`breakgraph.hf.registration`) being the break. Inductor's
own CUDA graphs are refused: the captured graphs are breakgraph's.
:class:`DecodeCompile` runs the compiles a capture would otherwise meet, up
front or in a thread of its own (:class:`BackgroundCompile`).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Mapping

import torch

from breakgraph.base.checks import refuse_unknown
from breakgraph.hf.cache import KVCache
from breakgraph.hf.steps import ModelForward
from breakgraph.hf.tracing import traces_take_turns
from breakgraph.serving.runner import GraphRunner

COMPILE_KEYWORDS = ("backend", "mode", "options", "dynamic", "fullgraph")
"""What ``Generator(compile={...})`` hands ``torch.compile``."""

_CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # Inductor's modes that add CUDA graphs of its own


def compile_keywords(compile: bool | Mapping[str, Any]) -> dict[str, Any] | None:
    """``torch.compile``'s keywords for ``Generator(compile=...)``, checked; None: not compiled.

    Arguments:
        compile (bool or mapping): True for Inductor's defaults, or the keywords of
            :data:`COMPILE_KEYWORDS` (``{"mode": "max-autotune-no-cudagraphs"}``, say).
    """
    if isinstance(compile, bool):
        return {} if compile else None
    if not isinstance(compile, Mapping):
        raise TypeError(f"compile must be a bool or a dict of torch.compile's keywords, got {type(compile).__name__}")
    keywords = dict(compile)
    refuse_unknown("Generator(compile=...)", keywords, COMPILE_KEYWORDS)
    if keywords.get("mode") in _CUDA_GRAPH_MODES:
        raise ValueError(
            f"torch.compile's mode {keywords['mode']!r} captures CUDA graphs of its own, inside breakgraph's: "
            "use the default mode or 'max-autotune-no-cudagraphs'"
        )
    if keywords.get("backend") == "cudagraphs":
        raise ValueError("torch.compile's backend 'cudagraphs' captures CUDA graphs of its own, inside breakgraph's: use 'inductor'")
    options = keywords.get("options") or {}
    if not isinstance(options, Mapping):
        raise TypeError(f"compile's options must be a dict of Inductor's options, got {type(options).__name__}")
    if options.get("triton.cudagraphs"):
        raise ValueError("Inductor's triton.cudagraphs captures CUDA graphs of its own, inside breakgraph's: leave it off")
    return keywords


def compiled_forward(model: torch.nn.Module, keywords: Mapping[str, Any]) -> Callable[..., Any]:
    """``model.forward`` compiled with ``keywords``, refusing to compile again inside a CUDA capture.

    A capture runs the compiled code after an eager warm-up at the same batch
    size, so it finds code compiled for it; a compile there would fail with
    CUDA's capture error, or later, so it is an error of its own. The first
    call makes the ``torch.compile`` wrapper, whose import of Inductor takes a
    second or two: a compile in the background takes that with it.
    """
    forward = None

    def run(**inputs: Any) -> Any:
        nonlocal forward
        if forward is None:
            forward = torch.compile(model.forward, **keywords)
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        with torch._dynamo.config.patch(error_on_recompile=True) if capturing else contextlib.nullcontext():
            return forward(**inputs)

    return run


class DecodeCompile:
    """The decode step's compiled forward, and the runs that compile it before a capture needs it.

    torch.compile specialises a batch of 1 and makes the batch dynamic on the
    second size it meets: run at the two smallest capture sizes, smallest
    first, two compiles serve every size, where the runner's largest-first
    warm-ups would need three.
    """

    def __init__(self, forward: Callable[..., Any], model_forward: ModelForward, cache: KVCache, runner: GraphRunner):
        self.forward = forward
        self._model_forward = model_forward
        self._cache = cache
        self._runner = runner
        self._device = model_forward.device

    def _sizes(self) -> list[int]:
        return sorted({size for sizes in self._runner.sizes_by_key.values() for size in sizes})[:2]

    @torch.inference_mode()
    def ahead(self) -> None:
        """Compile on the Generator's cache and the runner's own static inputs, before the first capture."""
        # torch.compile guards on a tensor's kind too, and one made under inference mode (as here)
        # is not the kind the runner passes.
        for size in self._sizes():
            self._model_forward(self._cache, **self._runner.inputs.views(size), compiled=self.forward)

    def on_a_twin(self) -> None:
        """:meth:`ahead` in a background thread, on a stream, a cache and inputs of its own: the
        step being served writes the Generator's."""
        cuda = self._device.type == "cuda"
        with torch.cuda.stream(torch.cuda.Stream(self._device)) if cuda else contextlib.nullcontext():
            twin = self._cache.twin()
            # Of the kind of the runner's static inputs, which torch.compile guards on: their shapes
            # and strides, and made under inference mode only if they were.
            views = [self._runner.inputs.views(size) for size in self._sizes()]
            with torch.inference_mode(next(iter(views[0].values())).is_inference()):
                sizes = [{name: torch.zeros_like(view) for name, view in inputs.items()} for inputs in views]
            with torch.inference_mode():
                for inputs in sizes:
                    self._model_forward(twin, **inputs, compiled=self.forward)
            if cuda:
                torch.cuda.current_stream(self._device).synchronize()


class BackgroundCompile:
    """``work`` (a compile) run once in a thread of its own, while the caller goes on serving;
    its torch.fx traces and the caller's eager forwards take turns (:mod:`breakgraph.hf.tracing`).

    :attr:`finished` says whether it ended; :meth:`error` waits for it and
    returns what it raised. The thread is a daemon: a process that ends
    mid-compile does not wait for it.
    """

    def __init__(self, work: Callable[[], None]):
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(work,), name="breakgraph-compile", daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            with traces_take_turns():  # the serving thread's eager forwards would go into its traces
                work()
        except BaseException as error:  # handed to the caller's thread by error()
            self._error = error

    @property
    def finished(self) -> bool:
        return not self._thread.is_alive()

    def error(self) -> BaseException | None:
        """Wait for the compile to end; return what it raised, if anything."""
        self._thread.join()
        return self._error
