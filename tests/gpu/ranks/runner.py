"""A runner that agrees by itself: ``GraphRunner(..., group=...)`` with nothing wired by hand.

A tensor-parallel MLP step (column-parallel, then row-parallel and an
``all_reduce`` in the segment, a plain break and a break that is a
collective) served by runners given the world group:

- live batches of a different size on each rank: every rank pads to the
  largest, replays the same graph (or runs eagerly above the largest size,
  all together), and its live rows match eager;
- lazy capture, in step on every rank, in breakable and full mode;
- the ranks exchange once for all sizes, as their one agreement ends, where no
  break issues a collective;
- a size whose capture fails on one rank only: every rank gives up the sizes
  captured under the one agreement and captures each under its own; with
  ``on_capture_error="eager"`` every rank serves that size eagerly; with
  "raise" every rank raises, and a new capture works;
- a failure at a size that was not warmed up, on one rank only, the way lazy
  initialisation fails inside a capture until an eager run: every rank warms
  up and captures it again.
"""

import random
from typing import Callable

import torch
import torch.distributed as dist

import breakgraph as bg
from tests.gpu.ranks._ranks import passed, say, start
from tests.helpers import poison_

HIDDEN, INNER, MAX_ROWS = 64, 128, 16


class Simulated(RuntimeError):
    """A capture failure of one rank's own."""


@bg.eager_on_graph(inline=True)  # capturable as it is: full mode records it in the graph
def normalized(h):
    return h / (h.norm(dim=-1, keepdim=True) + 1)


@bg.eager_on_graph
def summed(x):
    total = x.clone()
    dist.all_reduce(total)
    return total


@summed.inline
def summed_in_graph(x):
    total = x.clone()
    dist.all_reduce(total)  # captured into the full graph
    return total


class Step:
    """The tensor-parallel step, with failures that one rank can be told to make."""

    def __init__(self, rank: int, world: int):
        torch.manual_seed(1000 + rank)  # each rank's shard of the weights
        self.up = torch.randn(HIDDEN, INNER // world, device="cuda") / HIDDEN**0.5
        self.down = torch.randn(INNER // world, HIDDEN, device="cuda") / INNER**0.5
        self.out = torch.randn(HIDDEN, HIDDEN, device="cuda") / HIDDEN**0.5
        self.fail_at: dict[int, type] = {}  # capture size -> what this rank's captures raise there
        self.uninitialised: set[int] = set()  # sizes whose captures fail until an eager run initialises them

    def __call__(self, x):
        rows = x.shape[0]
        if bg.is_capturing() and rows in self.fail_at:
            raise self.fail_at[rows](f"rank {dist.get_rank()} fails the capture of size {rows}")
        if rows in self.uninitialised:
            if bg.is_capturing():
                x.sum().item()  # a host sync, as a library's first call may make: refused in a capture
            else:
                self.uninitialised.discard(rows)
        h = torch.relu(x @ self.up) @ self.down
        dist.all_reduce(h)
        return summed(normalized(h) @ self.out) + h


def batches_match_eager(runner: bg.GraphRunner, step: Callable, rank: int, calls: int = 20, seed: int = 0) -> set:
    """``calls`` live batches, of a different size on each rank (above the largest size now and
    then); each rank's rows equal eager's on the batch padded to the largest of any rank. Returns
    the row counts every rank was padded to."""
    sizes = random.Random(seed * 100 + rank)
    padded_to, last = set(), None
    for _ in range(calls):
        n = sizes.choice([1, 2, 3, 5, 8, 13, 16, 21]) if sizes.random() < 0.9 else MAX_ROWS + 5
        x = torch.randn(n, HIDDEN, device="cuda")
        largest = torch.tensor([n], device="cuda")
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        rows = int(largest.item())
        padded_to.add(rows)
        if last is not None:
            poison_(last)  # the static output the last call returned: a replay that does not write it shows
        last = runner(x)
        got = last.clone()
        padded = torch.zeros(rows, HIDDEN, device="cuda")
        padded[:n] = x
        expected = step(padded)[:n]
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    return padded_to


def main() -> None:
    rank, world = start()
    failing = world - 1
    step = Step(rank, world)
    static = torch.zeros(MAX_ROWS, HIDDEN, device="cuda")
    sizes = [1, 2, 4, 8, 16]

    for mode in ("breakable", "full"):
        runner = bg.GraphRunner(step, static, sizes, group=dist.group.WORLD, modes=mode, progress=False).capture()
        padded_to = batches_match_eager(runner, step, rank)
        assert sorted(size for _key, size in runner.graphs) == sizes
        say(f"{mode}: 20 batches of different sizes per rank match eager, padded to {sorted(padded_to)}")

    def no_collective_in_breaks(x):
        h = torch.relu(x @ step.up) @ step.down
        dist.all_reduce(h)  # in the segment
        return normalized(h) @ step.out

    quiet = bg.GraphRunner(no_collective_in_breaks, static, sizes, group=dist.group.WORLD, progress=False).capture()
    assert quiet.ranks.agreement.exchanges == 1, quiet.ranks.agreement.exchanges
    batches_match_eager(quiet, no_collective_in_breaks, rank, seed=5)
    say(f"breaks without collectives: one exchange for all {len(sizes)} sizes, at the end of their agreement")

    lazy = bg.GraphRunner(step, static, sizes, group=dist.group.WORLD, lazy=True, progress=False).capture()
    batches_match_eager(lazy, step, rank, seed=1)
    captured = torch.tensor(sorted(size for _key, size in lazy.graphs) + [0] * (len(sizes) - len(lazy.graphs)), device="cuda")
    every = [torch.empty_like(captured) for _ in range(world)]
    dist.all_gather(every, captured)
    assert all(torch.equal(other, captured) for other in every), "ranks captured different sizes lazily"
    say(f"lazy: sizes {[size for _key, size in sorted(lazy.graphs)]} captured in step on every rank")

    if rank == failing:
        step.fail_at[4] = Simulated
    served = bg.GraphRunner(step, static, sizes, group=dist.group.WORLD, on_capture_error="eager", progress=False).capture()
    step.fail_at.clear()
    report = served.report(print_table=False)
    assert [row["size"] for row in report["failed"]] == [4], report["failed"]
    assert (None, 4) not in served.graphs
    batches_match_eager(served, step, rank, seed=2)
    say("a size failing on one rank is served eagerly on every rank")

    if rank == failing:
        step.fail_at[8] = Simulated
    raising = bg.GraphRunner(step, static, sizes, group=dist.group.WORLD, progress=False)
    try:
        raising.capture()
    except Simulated:
        assert rank == failing
    except bg.PeerCaptureError as error:
        assert rank != failing and error.ranks == (failing,), error
    else:
        raise AssertionError(f"rank {rank} kept a capture that failed on rank {failing}")
    step.fail_at.clear()
    again = bg.GraphRunner(step, static, sizes, group=dist.group.WORLD, progress=False).capture()
    batches_match_eager(again, step, rank, seed=3)
    say("a size failing on one rank raises on every rank; a new runner captures and serves")

    if rank == failing:
        step.uninitialised.add(2)  # size 2 is captured without a warm-up (warmup="auto")
    retried = bg.GraphRunner(step, static, sizes, group=dist.group.WORLD, progress=False).capture()
    warmed_up = {row["size"] for row in retried.report(print_table=False)["rows"] if row["warmed_up"]}
    assert sorted(size for _key, size in retried.graphs) == sizes and warmed_up == {16, 2}, warmed_up
    batches_match_eager(retried, step, rank, seed=4)
    say("a lazy initialisation on one rank: every rank warmed size 2 up and captured it again")
    del runner, quiet, lazy, served, raising, again, retried  # their graphs launch into NCCL's communicator
    passed()


if __name__ == "__main__":
    main()
