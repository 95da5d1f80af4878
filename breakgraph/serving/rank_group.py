"""The ranks a runner serves with (``GraphRunner(..., group=...)``): what they agree on, and how.

Tensor-parallel ranks replay graphs whose collectives pair with each
other's, so every choice a runner makes must be the same on every rank:
whether a capture is kept, whether a failed capture is warmed up and tried
again, which graph size a live batch goes to, and whether it runs eagerly.
:class:`RankGroup` makes each of those choices once for all ranks, through
small exchanges over a gloo group of the same ranks: gloo exchanges never
pair with the model's NCCL collectives, keep working after a CUDA error on
one rank, and end with an error when a peer's process is gone or a peer
stays silent past ``timeout``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Callable, Sequence, TypeVar

import torch
import torch.distributed as dist

from breakgraph.base.ranks import CaptureAgreement, PeerBarrier, peers_lost

T = TypeVar("T")

KEEP, RETRY, GIVE_UP = 0, 1, 2
"""What a rank reports after a failed capture: nothing of its own to retry (its capture was
kept, or a peer's failed), a failure that a warm-up may fix, or one that it cannot."""


class RankGroup:
    """The ranks of ``group``, agreeing through a gloo group of their own.

    Arguments:
        group (torch.distributed.ProcessGroup, optional): the model's ranks (an NCCL
            group, say). None: the default group.
        timeout (float): seconds an exchange waits for a silent peer before it raises.
    """

    def __init__(self, group: "dist.ProcessGroup | None", timeout: float):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "group= needs torch.distributed: call torch.distributed.init_process_group() on every rank "
                "before making the runner"
            )
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        # Made by the group's ranks alone (use_local_synchronization), so ranks of other
        # groups (pipeline stages, say) need not make it with them.
        self.exchanges = dist.new_group(
            ranks, timeout=timedelta(seconds=timeout), backend="gloo", use_local_synchronization=True
        )
        self.timeout = timeout
        self.agreement = CaptureAgreement(self.exchanges)
        self.barrier = PeerBarrier(self.agreement.barrier)

    def capture(self, tag: int, attempt: Callable[[Callable[[], None]], T], discard: Callable[[T], object]) -> T:
        """``attempt(barrier)`` (a capture whose ``barrier_fn`` is ``barrier``, a
        :class:`PeerBarrier`) kept on every rank or raised on every rank; ``discard(result)``
        on a rank whose capture succeeded where a peer's failed.

        Arguments:
            tag (int): what every rank must be capturing (the runner's key and size).
            attempt (callable): makes the capture, given the barrier to pass as ``barrier_fn``.
            discard (callable): frees what ``attempt`` made (``graph.reset``).
        """
        (made,) = self.capture_each([tag], lambda _index, barrier: attempt(barrier), lambda made: discard(made[0]))
        return made

    def capture_each(
        self, tags: Sequence[int], attempt: Callable[[int, Callable[[], None]], T], discard: Callable[[list[T]], object]
    ) -> list[T]:
        """``attempt(index, barrier)`` for every tag in turn, under one agreement: the ranks
        meet at its barriers and once at the end, rather than once a capture, and every
        capture is kept on every rank, or all are raised on every rank. Each exchange
        carries the tag of the capture it falls in, so ranks at different captures find
        out; ``discard(made)`` frees the captures of a rank whose own succeeded, or that
        failed part way.

        Arguments:
            tags (sequence of int): what every rank must be capturing, in order.
            attempt (callable): makes capture ``index``, given the barrier to pass as ``barrier_fn``.
            discard (callable): frees a list of what ``attempt`` made.
        """
        made: list[T] = []

        def drop() -> None:
            kept = made[:]
            made.clear()
            if kept:
                discard(kept)

        agreement = self.agreement
        agreement.discard = drop
        try:
            with agreement:
                for index, tag in enumerate(tags):
                    agreement.tag = tag
                    made.append(attempt(index, self.barrier))
        except BaseException:
            drop()  # what this rank made before its own capture failed
            raise
        finally:
            # The capture's options hold the barrier, and so the agreement: were the agreement to
            # hold the captures on, the two would keep each other (and graphs whose collectives
            # NCCL waits for as its process group is destroyed) until a garbage collection.
            agreement.discard = None
        return made

    def retry_together(self, report: int) -> bool:
        """After a capture failed on some rank (and so raised on every rank): whether every
        rank warms up and captures again. Each rank reports KEEP, RETRY or GIVE_UP; all
        retry when some rank reported RETRY and none GIVE_UP.

        Arguments:
            report (int): this rank's KEEP, RETRY or GIVE_UP.
        """
        return self._largest([report], "whether to retry a failed capture")[0] == RETRY

    def dispatch(self, n: int, preference: Sequence[int]) -> int:
        """The largest batch of any rank, once every rank has chosen the same keys in the same
        order: each rank then pads to it and walks the same keys, so every rank replays the
        same graph or every rank runs eagerly.

        Arguments:
            n (int): this rank's live rows.
            preference (sequence of int): the indices of the keys this rank's batch may go
                to, most preferred first, padded with -1 to the runner's number of keys.
        """
        (largest,), agreed = self._agree([n], preference, "the batch size")
        if not agreed:
            raise ValueError(
                "the ranks' key_fn chose different keys for one step: every rank must serve the same graph "
                "variant (the same keys, in the same order), since its collectives pair with the other ranks'"
            )
        return largest

    def same(self, values: Sequence[int], what: str) -> None:
        """Raise on every rank alike unless every rank passed the same ``values``.

        Arguments:
            values (sequence of int): this rank's.
            what (str): what they are, for the error.
        """
        if not self._agree([], values, what)[1]:
            raise ValueError(f"the ranks disagree on {what}: every rank must make the same call, in the same order")

    def broadcast(self, tensor: torch.Tensor, source: int = 0) -> torch.Tensor:
        """``tensor`` (a CPU tensor) set in place to rank ``source``'s, on every rank.

        Arguments:
            tensor (torch.Tensor): a CPU tensor of the same shape and dtype on every rank.
            source (int): the group rank whose tensor every rank takes. Default: 0.
        """
        try:
            dist.broadcast(tensor, dist.get_global_rank(self.exchanges, source), group=self.exchanges)
        except RuntimeError as error:
            raise peers_lost(self.timeout) from error
        return tensor

    def _agree(self, largest: Sequence[int], same: Sequence[int], what: str) -> tuple[list[int], bool]:
        """The largest of each of ``largest`` over the ranks, and whether every rank passed the
        same ``same``, in one exchange: a value's largest and its negation's largest are
        opposites only where every rank passed the same value."""
        largest, same = [int(value) for value in largest], [int(value) for value in same]
        table = self._largest([*largest, *same, *(-value for value in same)], what)
        highest, lowest = table[len(largest) : len(largest) + len(same)], table[len(largest) + len(same) :]
        return table[: len(largest)], highest == [-value for value in lowest]

    def _largest(self, values: list[int], what: str) -> list[int]:
        table = torch.tensor(values, dtype=torch.int64)
        try:
            dist.all_reduce(table, op=dist.ReduceOp.MAX, group=self.exchanges)
        except RuntimeError as error:
            raise peers_lost(self.timeout, f" while agreeing on {what}") from error
        return table.tolist()
