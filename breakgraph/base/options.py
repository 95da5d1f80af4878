"""What a capture and a runner are asked to do: checked once, where the user says it.

Every entry point (the context manager, ``BreakableCUDAGraph.capture_begin``,
``graphed``, ``GraphRunner``) builds one of these objects from what it was
given and passes the object down; nothing below parses an option again. An
option is checked the same way with and without a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Mapping, TypeVar

import torch

from breakgraph_bindings import CaptureMode
from breakgraph.base.checks import (
    refuse_unknown,
    require_bool,
    require_callable,
    require_choice,
    require_number,
    require_optional_bool,
)

RANDOM_OPS = ("graph", "break", "error")
BREAKS = ("eager", "inline")
MODES = ("breakable", "full", "none")
"""A runner key's graph mode: breaks eager between segments, breaks inline in one full graph, or no graphs."""

O = TypeVar("O", bound="_CaptureChoices")


@functools.cache
def _defaults(cls: type[O]) -> O:
    """One instance of each options class with every default, shared: they are frozen."""
    return cls()


@dataclass(frozen=True, kw_only=True)
class _CaptureChoices:
    """The choices a capture and a runner share; see :class:`CaptureOptions`."""

    capture_error_mode: CaptureMode | str = "global"
    random_ops: str = "graph"
    generators: tuple[torch.Generator, ...] = ()
    barrier_fn: Callable[[], Any] | None = None
    measure_memory: bool = False

    def __new__(cls, *positional: Any, **by_name: Any):
        """Name a misspelt option and the closest known one, which the dataclass ``__init__``
        would not; positional arguments pass on to that ``__init__``, which refuses them."""
        refuse_unknown(cls.__name__, by_name, cls.names())
        return super().__new__(cls)

    def __post_init__(self) -> None:
        object.__setattr__(self, "capture_error_mode", CaptureMode.parse(self.capture_error_mode))
        require_choice("random_ops", self.random_ops, RANDOM_OPS)
        require_callable("barrier_fn", self.barrier_fn)
        require_bool("measure_memory", self.measure_memory)
        generators = self.generators
        if isinstance(generators, torch.Generator) or not isinstance(generators, (tuple, list)):
            raise TypeError(f"generators must be a tuple of CUDA torch.Generator objects, got {generators!r}")
        for gen in generators:
            if not isinstance(gen, torch.Generator) or gen.device.type != "cuda":
                raise TypeError(f"generators must be CUDA torch.Generator objects, got {gen!r}")
        object.__setattr__(self, "generators", tuple(generators))

    @classmethod
    def build(cls: type[O], owner: str, options: O | None, by_name: Mapping[str, Any]) -> O:
        """``options`` (or the defaults) with ``by_name`` set on top; an unknown name is
        refused, naming the closest option ``owner`` takes."""
        if options is not None and not isinstance(options, cls):
            raise TypeError(f"{owner}(options=...) takes a breakgraph.{cls.__name__}, got {type(options).__name__}")
        if not by_name:  # the common case, without checking the options again: they are frozen
            return options if options is not None else _defaults(cls)
        refuse_unknown(owner, by_name, cls.names())
        return dataclasses.replace(options or _defaults(cls), **by_name)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(field.name for field in dataclasses.fields(cls))


@dataclass(frozen=True, kw_only=True)
class CaptureOptions(_CaptureChoices):
    """How one capture treats what it meets.

    Arguments:
        capture_error_mode (str, optional): CUDA's capture mode, "global"
            (default), "thread_local" or "relaxed", as for ``torch.cuda.graph``.
        random_ops (str, optional): "graph" (default): random ops are
            captured into the segments (torch captures the segments that
            draw) and draw fresh numbers at every replay; "break": every
            random op becomes an eager break; "error": random ops fail the
            capture.
        generators (tuple of torch.Generator, optional): CUDA generators the
            captured random ops may draw from beside the device's default
            one. Default: none.
        breaks (str, optional): "eager" (default): every break splits the
            graph; "inline": one full graph, each ``@eager_on_graph`` function
            recording its capturable variant.
        barrier_fn (callable, optional): called after a segment ends and before
            each break runs, before each collective a break issues, and once at
            the end, so tensor-parallel ranks stay in step during capture
            (``CaptureAgreement.barrier``). Default: None.
        measure_memory (bool, optional): measure each segment executable's
            device memory (``cudaMemGetInfo`` around its instantiation).
            Default: False, since it costs start-up time.
    """

    breaks: str = "eager"

    def __post_init__(self) -> None:
        super().__post_init__()
        require_choice("breaks", self.breaks, BREAKS)


@dataclass(frozen=True, kw_only=True)
class RunnerOptions(_CaptureChoices):
    """How a :class:`~breakgraph.GraphRunner` captures, dispatches and serves.

    A runner sets each key's ``breaks`` through ``modes``.

    Arguments:
        capture_error_mode, random_ops, generators, barrier_fn, measure_memory:
            as for :class:`CaptureOptions`, for every size's capture.
        pad_value (int or float, optional): what the rows between a live batch
            and its captured size are filled with. Default: 0.
        clone (bool, optional): return copies of the outputs rather than views of
            static buffers that the next call overwrites. Default: False.
        warmup ("auto" or int, optional): "auto" (default) runs ``fn`` eagerly
            once per key, before its first capture, and again for a size whose
            capture fails the way lazy initialisation fails; an int runs it that
            many times before every size's capture.
        lazy (bool, optional): capture each (key, size) the first time a batch
            needs it rather than all up front. Default: False.
        progress (bool, optional): show a progress bar while capturing. Default: True.
        debug (bool, optional): debug mode; None (default): ``BREAKGRAPH_DEBUG=1`` decides.
        modes (str or dict, optional): each key's graph mode, one for all keys or
            a dict: "breakable" (default), "full" or "none".
        before_replay, after_replay (callable, optional): called around every
            replay (not around eager runs). Default: None.
        on_capture_error (str, optional): "raise" (default) propagates a failed
            capture; "eager" serves that size eagerly and logs why once.
        share_executables (bool, optional): keep one executable per segment and
            topology for all sizes of a key (``cudaGraphExecUpdate``), for less
            device memory. Default: False.
        group (torch.distributed.ProcessGroup, optional): the tensor-parallel ranks
            this runner serves with. Every rank then keeps each capture or none
            does, warms up and retries together, pads to the largest batch of any
            rank, and runs eagerly together (docs/multi-gpu.md). Every rank of the
            group makes its runner, with the same sizes and keys, in the same
            order. Default: None (one rank). Not with ``barrier_fn``.
        peer_timeout (float, optional): with ``group``, seconds an exchange
            between the ranks waits for a silent peer before it raises
            :class:`~breakgraph.PeerCaptureError` (a peer whose process is gone
            is noticed sooner). Default: 300.
        agree_batches (bool, optional): with ``group``, agree on every call's batch
            size and key (one host round trip between the ranks). False where the
            ranks are known to get the same batch, as tensor-parallel ranks fed by
            one scheduler do. Default: True.
    """

    pad_value: int | float = 0
    clone: bool = False
    warmup: int | str = "auto"
    lazy: bool = False
    progress: bool = True
    debug: bool | None = None
    modes: str | dict[Hashable, str] = "breakable"
    before_replay: Callable[[], Any] | None = None
    after_replay: Callable[[], Any] | None = None
    on_capture_error: str = "raise"
    share_executables: bool = False
    group: Any = None
    peer_timeout: float = 300.0
    agree_batches: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        require_number("pad_value", self.pad_value)
        for name in ("clone", "lazy", "progress", "share_executables", "agree_batches"):
            require_bool(name, getattr(self, name))
        require_optional_bool("debug", self.debug, "BREAKGRAPH_DEBUG=1 decides")
        parse_warmup(self.warmup, allow_auto=True)
        if isinstance(self.modes, str):
            require_choice("modes", self.modes, MODES)
        elif not isinstance(self.modes, dict):
            raise TypeError(f"modes must be one of {MODES} for every key, or a dict of key -> mode; got {self.modes!r}")
        require_callable("before_replay", self.before_replay)
        require_callable("after_replay", self.after_replay)
        require_choice("on_capture_error", self.on_capture_error, ("raise", "eager"))
        _require_group(self.group)
        if self.group is not None and self.barrier_fn is not None:
            raise ValueError(
                "give group= or barrier_fn=, not both: with group= the runner's ranks agree at every barrier "
                "themselves (a barrier_fn of your own would pair with no peer's)"
            )
        if not 0 < require_number("peer_timeout", self.peer_timeout) < math.inf:  # nan, too
            raise ValueError(f"peer_timeout must be a finite number of seconds > 0, got {self.peer_timeout!r}")

    def capture(self, breaks: str, measure_memory: bool, barrier_fn: Callable[[], Any] | None = None) -> CaptureOptions:
        """The options of one size's capture.

        Arguments:
            breaks (str): "eager" or "inline", from the key's mode.
            measure_memory (bool): whether this capture measures its executables.
            barrier_fn (callable, optional): the ranks' barrier (``group``); default: the runner's ``barrier_fn``.
        """
        shared = {name: getattr(self, name) for name in _CaptureChoices.names()}
        if barrier_fn is not None:
            shared["barrier_fn"] = barrier_fn
        return CaptureOptions(**{**shared, "breaks": breaks, "measure_memory": measure_memory})


def _require_group(group: Any) -> None:
    """A torch.distributed process group, or None."""
    if group is None:
        return
    if not torch.distributed.is_available() or not isinstance(group, torch.distributed.ProcessGroup):
        raise TypeError(
            f"group must be a torch.distributed ProcessGroup (the model's tensor-parallel group, or "
            f"torch.distributed.group.WORLD), got {type(group).__name__}"
        )


def parse_modes(modes: str | dict, keys: list) -> dict:
    """Each key's graph mode, from one mode for all or a dict with every key."""
    if isinstance(modes, str):
        modes = dict.fromkeys(keys, modes)
    if set(modes) != set(keys):
        declared = (
            "this runner has the one key None, since it was made without keys=: give one mode for all "
            "(modes='full'), or declare the keys with keys=[...] and key_fn=..."
            if keys == [None]
            else f"this runner's keys (keys=) are {keys}"
        )
        raise ValueError(f"modes gives keys {list(modes)}, but {declared}; a dict must give each key exactly one mode")
    for key, mode in modes.items():
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} of key {key!r} is not one of {MODES}")
    return dict(modes)


def parse_warmup(warmup: Any, allow_auto: bool) -> int | str:
    """How many eager runs come before a capture: a whole number >= 0, or (for a runner) "auto"."""
    if allow_auto and warmup == "auto":
        return warmup
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        choices = "'auto' or a number of eager runs >= 0" if allow_auto else "a number of eager runs >= 0"
        raise ValueError(f"warmup must be {choices}, got {warmup!r}")
    return warmup
