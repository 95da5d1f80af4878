"""The capture-time barrier: a user's is called after every segment ends and before each break
runs, before each collective a break issues, and at the end; a runner's peers meet only before
collectives (and as their agreement ends)."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import breakgraph as bg
import breakgraph_bindings as bindings
from breakgraph.base.ranks import PeerBarrier
from tests.helpers import assert_close

DEV = "cuda"


@pytest.fixture
def one_rank(tmp_path):
    """A gloo process group of this process alone: collectives that run, and pair with nobody."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, timeout=timedelta(seconds=30))
    yield
    dist.destroy_process_group()


def test_barrier_runs_before_each_break_and_each_collective_and_at_capture_end(one_rank):
    events = []
    stream = torch.cuda.Stream()

    def barrier():
        capturing = bindings.capture_status(stream) is not bindings.CaptureStatus.NONE
        events.append(("barrier", capturing))

    @bg.eager_on_graph
    def first(x):
        events.append(("first", bg.is_capturing()))
        return x + 1

    @bg.eager_on_graph
    def second(x):
        events.append(("second", bg.is_capturing()))
        dist.all_reduce(torch.ones(1))  # a collective: the ranks meet at the barrier first
        events.append(("all_reduce", bg.is_capturing()))
        return x * 3

    x = torch.randn(8, device=DEV)
    graph = bg.BreakableCUDAGraph()
    with bg.BreakableCUDAGraphCapture(graph, stream=stream, barrier_fn=barrier):
        out = second(first(x * 2) - 1) + 5
    # No segment is recording while the barrier runs; each break follows its barrier, and so
    # does each collective a break issues.
    assert events == [
        ("barrier", False), ("first", True), ("barrier", False), ("second", True),
        ("barrier", False), ("all_reduce", True), ("barrier", False),
    ]
    events.clear()
    fresh = torch.randn_like(x)
    x.copy_(fresh)
    graph.replay()
    assert_close(out, (fresh * 2 + 1 - 1) * 3 + 5)
    assert [name for name, _ in events] == ["first", "second", "all_reduce"]  # the barrier is for capture only


def test_a_runners_peer_barrier_is_met_before_collectives_only_and_learns_quiet_breaks(one_rank):
    met = []
    peers = PeerBarrier(lambda: met.append("barrier"))

    def quiet(x):
        met.append("quiet")
        return x + 1

    def collective(x):
        met.append("collective")
        dist.all_reduce(torch.ones(1))
        return x * 3

    quiet_break, collective_break = bg.eager_on_graph(quiet), bg.eager_on_graph(collective)
    x = torch.randn(8, device=DEV)
    for _ in range(2):  # the second capture (a runner's next size, say) meets the same barriers
        graph = bg.BreakableCUDAGraph()
        with bg.BreakableCUDAGraphCapture(graph, barrier_fn=peers):
            out = collective_break(quiet_break(x * 2) - 1) + 5
        assert met == ["quiet", "collective", "barrier"]  # the agreement's end is the runner's
        assert peers.quiet == {quiet}  # watched once for collectives, then no more
        met.clear()
        fresh = torch.randn_like(x)
        x.copy_(fresh)
        graph.replay()
        assert_close(out, (fresh * 2 + 1 - 1) * 3 + 5)
        met.clear()


def test_barrier_that_raises_fails_the_capture_cleanly():
    class Late(Exception):
        pass

    def barrier():
        raise Late("rank 1 did not arrive")

    with pytest.raises(Late):
        with bg.BreakableCUDAGraphCapture(bg.BreakableCUDAGraph(), barrier_fn=barrier):
            bg.break_graph()
    assert not bg.is_capturing()
    graph = bg.BreakableCUDAGraph()
    with bg.BreakableCUDAGraphCapture(graph):
        y = torch.ones(4, device=DEV) * 2
    graph.replay()
    assert_close(y, torch.full((4,), 2.0, device=DEV))
