"""Branches and loops the GPU decides: :func:`cond` and :func:`while_loop`.

Inside a breakable capture each call becomes one CUDA conditional node in the
segment being recorded: a one-thread kernel reads the predicate on the device,
and the node runs a branch's body graph, or the loop's body again, with no host
sync and no break. Everywhere else (outside a capture, without a GPU, inside an
eager break, and in debug mode, where the whole call is one eager break) they
run as Python ``if`` and ``while``, so model code that uses them runs anywhere.

A body is captured on a stream of its own into the node's body graph, with an
op watch (:mod:`~breakgraph.recording.body_watch`) that refuses what a body
graph cannot hold before CUDA sees it: a body
capture in which CUDA refused an operation cannot be ended without crashing
the driver (NVBUG 6805256), so its stream is abandoned, still capturing, and
the error says to restart.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

import breakgraph_bindings as bindings
from breakgraph.base import context, runtime, trees
from breakgraph.recording.body_watch import BodyWatch, synchronize_refusal
from breakgraph.recording.dispatch import UncapturableOpError, is_capture_violation, user_line

_IF_ELSE, _WHILE = bindings.ConditionalKind.IF_ELSE, bindings.ConditionalKind.WHILE

def cond(pred: torch.Tensor, true_fn: Callable, false_fn: Callable, *operands: Any) -> Any:
    """``true_fn(*operands)`` if ``pred`` is True, else ``false_fn(*operands)``, decided
    on the GPU inside a capture.

    Inside a breakable capture both branches are captured once, as the two bodies of
    one conditional node in the current segment; each replay runs the branch that
    ``pred`` picks on the device, with no host sync and no break. Elsewhere it is a
    Python ``if``.

    Arguments:
        pred (Tensor): a one-element ``torch.bool`` tensor; inside a capture, on the
            capture's GPU.
        true_fn, false_fn (callable): the branches. Inside a capture both must return
            the same structure of tensors, with the same shapes and dtypes, and hold
            only work a CUDA graph body can: no eager breaks, host syncs, random ops
            or collectives. Their Python runs once, at capture.
        *operands: passed to the branch.

    Returns:
        The branch's result. Inside a capture: tensors of the capture's pool that
        every replay overwrites with the taken branch's values.
    """
    _require_functions("cond", true_fn=true_fn, false_fn=false_fn)
    _require_predicate("cond's pred", pred)
    capture = context.current()
    if capture is None or not capture.segment_open:
        return _python_if(pred, true_fn, false_fn, *operands)
    if not capture.branches_on_device:
        return capture.run_break(_python_if_in_buffers_of_its_own, (pred, true_fn, false_fn, *operands), {}, "cond")
    bindings.require_conditional_support(_IF_ELSE, "breakgraph.cond inside a capture")
    _require_on_capture_device("cond's pred", pred)
    capture.conditional_node("cond()")
    node = bindings.add_conditional(torch.cuda.current_stream(), _IF_ELSE, pred.data_ptr())
    with _body(capture, node.bodies[0], "cond", "true_fn") as watch:
        result = _own_buffers(true_fn(*operands), watch)
    taken = trees.take_apart(result, objects=True)
    with _body(capture, node.bodies[1], "cond", "false_fn"):
        other = trees.take_apart(false_fn(*operands), objects=True)
        for into, value in _pairs(taken, other, "cond", "true_fn", "false_fn", pred.device):
            into.copy_(value)
    return result


def while_loop(cond_fn: Callable, body_fn: Callable, carried: tuple) -> tuple:
    """``while cond_fn(*carried): carried = body_fn(*carried)``, decided on the GPU
    inside a capture; returns the final ``carried``.

    Inside a breakable capture the loop is one conditional node in the current
    segment: each replay runs the body as many times as the predicate stays True on
    the device, with no host sync and no break. Elsewhere it is a Python ``while``.

    Arguments:
        cond_fn (callable): takes ``*carried`` and returns a one-element ``torch.bool``
            tensor.
        body_fn (callable): takes ``*carried`` and returns the next values, a tuple of
            tensors with the same shapes and dtypes. Inside a capture it holds only work
            a CUDA graph body can: no eager breaks, host syncs, random ops or
            collectives. Its Python runs once, at capture.
        carried (tuple of Tensor): the loop's initial values; never modified.

    Returns:
        tuple of Tensor: the values when ``cond_fn`` turned False. Inside a capture:
        tensors of the capture's pool that every replay overwrites.
    """
    _require_functions("while_loop", cond_fn=cond_fn, body_fn=body_fn)
    if not isinstance(carried, tuple) or not all(isinstance(value, torch.Tensor) for value in carried):
        raise TypeError(f"while_loop(carried=...) takes a tuple of tensors, got {_describe(carried)}")
    capture = context.current()
    if capture is None or not capture.segment_open:
        return _python_while(cond_fn, body_fn, carried)
    if not capture.branches_on_device:
        return capture.run_break(_python_while_in_buffers_of_its_own, (cond_fn, body_fn, carried), {}, "while_loop")
    bindings.require_conditional_support(_WHILE, "breakgraph.while_loop inside a capture")
    for index, value in enumerate(carried):
        _require_on_capture_device(f"while_loop's carried[{index}]", value)
    state = tuple(value.clone() for value in carried)  # the loop's own buffers: carried stays as it was
    first = cond_fn(*state)
    _require_predicate("while_loop's cond_fn result", first)
    _require_on_capture_device("while_loop's cond_fn result", first)
    capture.conditional_node("while_loop()")
    node = bindings.add_conditional(torch.cuda.current_stream(), _WHILE, first.data_ptr())
    with _body(capture, node.bodies[0], "while_loop", "body_fn") as watch:
        state_tree = trees.take_apart(state, objects=False)
        new = trees.take_apart(body_fn(*state), objects=False)
        pairs = list(_pairs(state_tree, new, "while_loop", "carried", "body_fn", first.device))
        # A value that is not the body's own may be another carried tensor (a swap): copy it first.
        values = [value if watch.made(value) or value is into else value.clone() for into, value in pairs]
        for (into, _), value in zip(pairs, values):
            if value is not into:
                into.copy_(value)
        again = cond_fn(*state)
        _require_predicate("while_loop's cond_fn result", again)
        _require_on_capture_device("while_loop's cond_fn result", again)
        bindings.set_conditional(torch.cuda.current_stream(), node.handle, again.data_ptr())
    return state


def _python_if(pred, true_fn, false_fn, *operands):
    return true_fn(*operands) if bool(pred) else false_fn(*operands)


def _python_while(cond_fn, body_fn, carried):
    carried = tuple(value.clone() for value in carried)  # as the captured loop: carried stays as it was
    while True:
        go_on = cond_fn(*carried)
        _require_predicate("while_loop's cond_fn result", go_on)
        if not bool(go_on):
            return carried
        new = body_fn(*carried)
        if not isinstance(new, tuple) or len(new) != len(carried):
            raise TypeError(f"while_loop's body_fn must return a tuple of {len(carried)} tensors, like carried; got {_describe(new)}")
        carried = new


def _python_if_in_buffers_of_its_own(pred, true_fn, false_fn, *operands):
    """Debug mode's break for ``cond``: its result in buffers of its own, as the conditional node's,
    so that no replay writes the other branch's result over an operand or a weight a branch returned."""
    return trees.map_tensors(torch.Tensor.clone, _python_if(pred, true_fn, false_fn, *operands), objects=True)


def _python_while_in_buffers_of_its_own(cond_fn, body_fn, carried):
    """Debug mode's break for ``while_loop``: as :func:`_python_if_in_buffers_of_its_own`."""
    return tuple(value.clone() for value in _python_while(cond_fn, body_fn, carried))


def _require_functions(construct: str, **functions) -> None:
    for name, function in functions.items():
        if not callable(function):
            raise TypeError(f"{construct}'s {name} must be a function, got {type(function).__name__}")


def _describe(value) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {', '.join(type(item).__name__ for item in value) or 'nothing'}"
    return type(value).__name__


def _require_predicate(what: str, pred) -> None:
    if not isinstance(pred, torch.Tensor) or pred.numel() != 1 or pred.dtype != torch.bool:
        given = f"a {pred.dtype} tensor of shape {tuple(pred.shape)}" if isinstance(pred, torch.Tensor) else type(pred).__name__
        raise TypeError(
            f"{what} must be a one-element torch.bool tensor, got {given}: compare to make one "
            "(loss.isfinite().all(), (tokens == eos).all()), and keep it on the GPU inside a capture"
        )


def _require_on_capture_device(what: str, tensor: torch.Tensor) -> None:
    device = torch.cuda.current_stream().device
    if tensor.device != device:
        raise ValueError(
            f"{what} is on {tensor.device}, but the capture runs on {device}: the GPU reads it at each replay, "
            "so it must live there (a CPU value would be frozen into the graph)"
        )


def _own_buffers(result, watch: BodyWatch):
    """``result`` with every tensor the branch did not make, or that another output shares,
    cloned in the body: the other branch writes into these buffers, so none may be an
    operand, a weight or another output."""
    seen: set[int] = set()

    def own(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage().data_ptr()
        if watch.made(tensor) and storage not in seen:
            seen.add(storage)
            return tensor
        return tensor.clone()

    return trees.map_tensors(own, result, objects=True)


def _pairs(first: trees.Flat, second: trees.Flat, construct: str, first_name: str, second_name: str, device: torch.device):
    """The (first, second) tensor leaves of two values that must match leaf for leaf, on the
    capture's ``device``; a difference in structure, shape, dtype, device or a non-tensor leaf
    is named."""
    if first.spec != second.spec:
        raise TypeError(
            f"{construct}: {first_name} and {second_name} must give the same structure, got {first.spec} and {second.spec}"
        )
    for index, (a, b) in enumerate(zip(first.leaves, second.leaves)):
        where = first.path(index, "result")
        if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor) or (not isinstance(a, torch.Tensor) and a != b):
            raise TypeError(f"{construct}: {where} is {a!r} from {first_name} but {b!r} from {second_name}")
        if not isinstance(a, torch.Tensor):
            continue
        if a.device != device:
            raise ValueError(
                f"{construct}: {where} from {first_name} is on {a.device}, but the capture runs on {device}: the GPU "
                "writes the result at each replay, so it must live there (a CPU tensor would keep the capture's value)"
            )
        for attribute in ("shape", "dtype", "device"):
            if getattr(a, attribute) != getattr(b, attribute):
                raise TypeError(
                    f"{construct}: {where} has {attribute} {getattr(a, attribute)} from {first_name} but "
                    f"{getattr(b, attribute)} from {second_name}; both must give the same"
                )
        if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
            raise TypeError(
                f"{construct} does not differentiate its branches ({where} requires grad): run it under "
                "torch.no_grad(), or make the whole call an eager break"
            )
        yield a, b


_LEFT_OPEN = (
    "The driver cannot end a body's capture after CUDA refused an operation in it without crashing (NVBUG "
    "6805256), so it was left open on a stream breakgraph will not use again, and CUDA may crash or hang at the "
    "next call: restart the process."
)
"""What a body's capture that CUDA refused an operation in became: the close of either error."""


@contextlib.contextmanager
def _body(capture, graph: bindings.Graph, construct: str, function: str):
    """Capture what runs in the block into ``graph``, a conditional node's body, on the body
    stream of this depth, with the body's op watch; a failure leaves no capture open."""
    device = torch.cuda.current_stream().device
    depth = capture.body_depth
    stream = runtime.body_stream(device, depth)
    # Relaxed: the capture around it already refuses unsafe calls, and an abandoned body
    # (see _close_failed) must not refuse them for the rest of the process.
    bindings.begin_body_capture(stream, graph, "relaxed")
    watch = BodyWatch(construct, function)
    try:
        with capture.inside_body(), runtime.on_stream(stream), synchronize_refusal.during(watch), watch:
            yield watch
    except BaseException as error:
        capture.body_failed(f"{construct}'s {function} failed ({type(error).__name__}: {error})")
        if _close_failed(stream, device, depth, refused_by_cuda=is_capture_violation(error)):
            raise UncapturableOpError(
                f"{user_line(error)} made CUDA refuse the capture of {construct}'s {function} ({error}). Keep it "
                f"out of the branch, or make the whole {construct} an eager break. {_LEFT_OPEN}"
            ) from error
        raise
    _end_body(capture, stream, device, depth, f"{construct}'s {function}")


def _end_body(capture, stream: torch.cuda.Stream, device: torch.device, depth: int, what: str) -> None:
    """End the capture of a body that ran to its end. One CUDA invalidated on the way (the
    body caught CUDA's refusal of an operation and went on) is abandoned, not ended, as
    after a refusal that reached :func:`_body`; a failed end fails the capture around it."""
    status = bindings.capture_status(stream)
    if status is not bindings.CaptureStatus.ACTIVE:
        ended = f"the capture of {what} was {status.name.lower()}"
        capture.body_failed(ended)
        runtime.abandon_body_stream(device, depth)
        raise UncapturableOpError(
            f"{ended} by the time it returned: CUDA refused an operation "
            "in it and the error was caught inside it. Let the error through (or keep the operation out of the "
            f"branch), or make the whole call an eager break. {_LEFT_OPEN}"
        )
    try:
        bindings.end_body_capture(stream)
    except bindings.CudaError as error:
        capture.body_failed(f"the capture of {what} could not be ended ({error})")
        raise UncapturableOpError(
            f"the capture of {what} could not be ended ({error}): a body that forks side streams must join "
            "them back into the stream it runs on before it returns."
        ) from error


def _close_failed(stream: torch.cuda.Stream, device: torch.device, depth: int, refused_by_cuda: bool) -> bool:
    """End a failed body's capture where that is safe; abandon its stream, and say so, where
    CUDA refused an operation in it (the capture may still read as active)."""
    status = bindings.capture_status(stream)
    if status is bindings.CaptureStatus.INVALIDATED or (refused_by_cuda and status is bindings.CaptureStatus.ACTIVE):
        runtime.abandon_body_stream(device, depth)
        return True
    if status is bindings.CaptureStatus.ACTIVE:
        with contextlib.suppress(bindings.CudaError):  # the error that failed the body is the one to report
            bindings.end_body_capture(stream)
    return False
