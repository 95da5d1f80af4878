"""Ranks that agree: captures that succeed or fail on every rank together, one batch size.

Tensor-parallel ranks run the same program, and the eager breaks of a
capture run their collectives for real. If one rank's capture fails while
the others go on, the others wait in a collective the failed rank never
joins: the job hangs. :class:`CaptureAgreement` keeps the ranks in step: at
every barrier (``barrier_fn``) and once at the end, each rank tells the
others whether it is still capturing, so either every rank keeps its
capture or every rank raises, and the next capture starts in step.

Each exchange is one ``all_reduce`` of a small integer tensor over the
process group (a CPU tensor for gloo, a tensor on the current CUDA device
otherwise). A rank that is late holds the others in that ``all_reduce``
until it arrives or the process group's timeout ends the job.
"""

from __future__ import annotations

import contextlib
from enum import IntEnum
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist


class PeerCaptureError(RuntimeError):
    """Another rank's capture failed, or the ranks' captures were out of step, so this
    rank's capture was abandoned too (every rank raises alike).

    ``ranks`` are the ranks (within the process group) whose capture failed; their own
    errors say why. ``out_of_step`` is True when no rank failed but the ranks reached
    the end after different numbers of breaks, or with different tags. ``lost`` is True
    when an exchange itself failed: a peer's process is gone, or a peer stayed silent
    past the exchange group's timeout; the error's cause is the process group's.
    """

    def __init__(self, message: str, ranks: Sequence[int] = (), out_of_step: bool = False, lost: bool = False):
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.out_of_step = out_of_step
        self.lost = lost


def peers_lost(timeout: float | None = None, where: str = "") -> PeerCaptureError:
    """The error of an exchange that failed: a peer's process is gone, or it stayed silent."""
    silent = "the exchange group's timeout" if timeout is None else f"{timeout:g} s (peer_timeout)"
    return PeerCaptureError(
        f"an exchange with the other ranks failed{where}: a peer rank's process is gone, or it did not answer "
        f"within {silent}. The ranks are out of step for good: end the job (or make a new process group) and "
        "look for the rank that stopped, whose own error or exit says why.",
        lost=True,
    )


class _Step(IntEnum):
    """What a rank reports in an exchange (0 is reserved for "no report")."""

    BARRIER = 1  # a barrier inside the capture: still capturing
    END = 2  # the capture ended and was kept on this rank
    FAILED = 3  # this rank's capture failed; its own error is raised there


_FIELDS = 3  # step, tag, tag present
_INT64 = (-(2**63), 2**63 - 1)


class CaptureAgreement:
    """Keeps the ranks of ``group`` in step while they capture: all keep, or all raise.

    Use it around a capture (or around ``GraphRunner.capture()``), and pass
    :meth:`barrier` as the capture's ``barrier_fn``::

        agreement = breakgraph.CaptureAgreement(gloo_group, discard=graph.reset)
        with agreement:
            with breakgraph.BreakableCUDAGraphCapture(graph, barrier_fn=agreement.barrier):
                static_out = model(static_in)

    A rank whose capture fails tells the others at their next exchange and
    raises its own error; the others raise :class:`PeerCaptureError` (from the
    barrier, so their capture aborts, or at the end, after ``discard()`` drops
    the graph they had captured). ``tag`` (an int, e.g. the batch size) must be
    the same on every rank; ranks that reach the end after a different number
    of barriers, or with different tags, all raise ``PeerCaptureError`` too,
    instead of pairing unrelated collectives. The object can be entered again
    for the next capture.

    Only failures between exchanges are covered: a rank that fails inside a
    break's own collective, or in an eager warm-up run, leaves the others
    waiting in that collective. A gloo ``group`` of its own
    (``dist.new_group(backend="gloo")``) keeps the exchanges apart from the
    model's NCCL collectives and working after a CUDA error.

    Arguments:
        group (torch.distributed.ProcessGroup, optional): the ranks that agree.
            Default: the default group.
        tag (int, optional): what every rank must agree on (e.g. the batch size).
        discard (callable, optional): called on a rank whose own capture
            succeeded when a peer's failed (e.g. ``graph.reset``).
    """

    def __init__(self, group: "dist.ProcessGroup | None" = None, tag: int | None = None, discard: Callable[[], Any] | None = None):
        if discard is not None and not callable(discard):
            raise TypeError(f"discard must be callable (e.g. graph.reset), got {type(discard).__name__}")
        self.group = group
        self.tag = tag
        self.discard = discard
        self.exchanges = 0
        self._table: torch.Tensor | None = None
        self._open = self._settled = self._interrupted = False

    @property
    def tag(self) -> int | None:
        """An int every rank must agree on for the next capture (e.g. its batch size), or None."""
        return self._tag

    @tag.setter
    def tag(self, tag: int | None) -> None:
        if tag is not None and (not isinstance(tag, int) or not _INT64[0] <= tag <= _INT64[1]):
            raise TypeError(f"tag must be a 64-bit int that every rank agrees on (e.g. the batch size), got {tag!r}")
        self._tag = tag

    # -- the protocol ----------------------------------------------------------------------
    def barrier(self) -> None:
        """Called inside the capture (``barrier_fn``): wait for every rank, and raise
        :class:`PeerCaptureError` if another rank's capture failed or is out of step."""
        if not self._open:
            raise RuntimeError("CaptureAgreement.barrier() runs inside 'with agreement:'; enter the agreement first")
        self._raise_unless_agreed(self._exchange(_Step.BARRIER))

    def __enter__(self) -> "CaptureAgreement":
        if self._interrupted:
            raise RuntimeError(
                "an exchange of this CaptureAgreement was interrupted after it was sent, so the ranks may be out "
                "of step: make a new process group (and agreement) before capturing again"
            )
        if self._open:
            raise RuntimeError("this CaptureAgreement is already in use; one capture at a time")
        device = _device_for(self.group)
        # Made here, outside the capture, so no exchange allocates from a graph's pool.
        self._table = torch.zeros(dist.get_world_size(self.group), _FIELDS, dtype=torch.int64, device=device)
        self._open, self._settled = True, False
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self._open = False
        if self._settled or self._interrupted:  # every rank already knows how this capture ends, or cannot
            return
        if error is not None:
            try:
                self._exchange(_Step.FAILED)  # the others learn it at their next exchange
            except PeerCaptureError:
                pass  # the peers are gone: this rank's own error says more
            return
        try:
            self._raise_unless_agreed(self._exchange(_Step.END))
        except PeerCaptureError as peer:
            if self.discard is not None:
                try:
                    self.discard()
                except Exception as failure:
                    raise peer from failure
            raise

    def _raise_unless_agreed(self, reports: list[tuple[int, int | None]]) -> None:
        """Raise on every rank alike unless every rank reported the same step and tag."""
        failed = [rank for rank, (step, _tag) in enumerate(reports) if step == _Step.FAILED]
        if failed:
            many = len(failed) > 1
            whose = "their" if many else "that rank's"
            raise PeerCaptureError(
                f"the capture failed on rank{'s' if many else ''} {', '.join(map(str, failed))} of the group's "
                f"{len(reports)}, so this rank gives up its capture too, to stay in step; {whose} own "
                f"error says why. Fix it there and capture again on every rank.",
                failed,
            )
        if len(set(reports)) > 1:
            where = "; ".join(
                f"rank {rank} {'at a barrier' if step == _Step.BARRIER else 'at the end'}"
                + ("" if tag is None else f" with tag {tag}")
                for rank, (step, tag) in enumerate(reports)
            )
            raise PeerCaptureError(
                f"the ranks' captures are out of step ({where}): every rank must capture the same program "
                f"(the same breaks) with the same tag (e.g. the same batch size). Every rank gives up its capture.",
                out_of_step=True,
            )

    def _exchange(self, step: _Step) -> list[tuple[int, int | None]]:
        """One all_reduce: every rank's step and tag, in group rank order. Marks the capture
        settled when the reports end it (a failure, ranks out of step, or all at the end)."""
        table, rank = self._table, dist.get_rank(self.group)
        table.zero_()
        table[rank, 0] = int(step)
        if self.tag is not None:
            table[rank, 1], table[rank, 2] = self.tag, 1
        # From here this rank may have joined the collective: if it cannot read the result,
        # it must not exchange again in this capture (the others will not).
        self._interrupted = True
        try:
            dist.all_reduce(table, op=dist.ReduceOp.SUM, group=self.group)
        except RuntimeError as error:  # torch.distributed's errors (a closed connection, a timeout)
            raise peers_lost() from error
        reports = [(reported, tag if present else None) for reported, tag, present in table.cpu().tolist()]
        self.exchanges += 1
        self._settled = step != _Step.BARRIER or len(set(reports)) > 1
        self._interrupted = False
        return reports


class PeerBarrier:
    """A runner's barrier with its peer ranks (``GraphRunner(..., group=...)``), met only where
    a capture runs work that pairs with theirs: before each collective an eager break issues
    through ``torch.distributed``. A ``barrier_fn`` of the user's is also met before every break
    and at the capture's end; the runner's is not, since an exchange at every break would cost
    its capture more than the breaks themselves, and its agreement's end follows its captures.

    Finding a break's collectives means watching its every op, which costs about as much
    again as the break: a break function whose capture issued none is in ``quiet`` from then
    on, and its later captures (this runner's other sizes) run unwatched.

    Arguments:
        barrier (callable): the exchange itself (``CaptureAgreement.barrier``).
    """

    def __init__(self, barrier: Callable[[], Any]):
        self.barrier = barrier
        self.quiet: set[Callable] = set()

    def __call__(self) -> None:
        self.barrier()

    def is_quiet(self, function: Callable) -> bool:
        """Whether the break ``function`` issued no collective at an earlier capture."""
        try:
            return function in self.quiet
        except TypeError:  # an unhashable callable is watched every time
            return False

    def found_quiet(self, function: Callable) -> None:
        with contextlib.suppress(TypeError):
            self.quiet.add(function)


def agreed_batch_size(n: int, group: "dist.ProcessGroup | None" = None) -> int:
    """The largest of every rank's batch size ``n``: pad to it, and every rank replays the
    same graph size (graphs with collectives inside must match across ranks), or every
    rank runs eagerly. One ``all_reduce`` per call: a host sync.

    Arguments:
        n (int): this rank's batch size.
        group (torch.distributed.ProcessGroup, optional): the ranks. Default: the default group.
    """
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a batch size (an int >= 0), got {n!r}")
    size = torch.tensor([n], dtype=torch.int64, device=_device_for(group))
    dist.all_reduce(size, op=dist.ReduceOp.MAX, group=group)
    return int(size.item())


def _device_for(group) -> torch.device:
    """Where a collective's tensor must live for ``group``: the CPU when the group has gloo
    (``"gloo"``, ``"cpu:gloo,cuda:nccl"``), else the current CUDA device."""
    if not dist.is_initialized():
        raise RuntimeError("ranks need torch.distributed: call torch.distributed.init_process_group() first")
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())
