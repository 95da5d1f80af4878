"""Failures never hang: a rank that fails in a segment, or in a break before its collective, and
ranks out of step, around real captures with NCCL collectives.

The failing rank raises its own error, every other rank raises
``PeerCaptureError`` naming it (or ``out_of_step``), and the next capture works
on every rank: its replays match eager, so every rank's collectives are still
paired with the same ones.
"""

from datetime import timedelta

import torch
import torch.distributed as dist

import breakgraph as bg
from tests.gpu.ranks._ranks import passed, replays_match_eager, say, start

ROWS, HIDDEN = 8, 64


class Simulated(RuntimeError):
    """A failure in a break's own code, before its collective."""


@bg.eager_on_graph
def summed(x, fail: bool):
    if fail:
        raise Simulated("the break failed before its all_reduce")
    total = x.clone()
    dist.all_reduce(total)
    return total


def model(x, w, fail_in: str | None, failing: bool):
    h = x @ w
    dist.all_reduce(h)  # captured in the first segment
    if fail_in == "segment" and failing:
        h = h[h.sum(-1) > 0]  # boolean indexing: a host sync, which a capture refuses
    h = summed(torch.relu(h), fail_in == "break" and failing)
    return h @ w


def main() -> None:
    rank, world = start()
    failing_rank = world - 1
    exchanges = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))
    agreement = bg.CaptureAgreement(exchanges)
    torch.manual_seed(rank)
    w = torch.randn(HIDDEN, HIDDEN, device="cuda") / HIDDEN**0.5
    x = torch.randn(ROWS, HIDDEN, device="cuda")
    model(x, w, None, False)  # warm up outside the captures
    torch.cuda.synchronize()

    def capture(fail_in=None, tag=0):
        graph = bg.BreakableCUDAGraph()
        agreement.tag, agreement.discard = tag, graph.reset
        with agreement:
            with bg.BreakableCUDAGraphCapture(graph, barrier_fn=agreement.barrier):
                out = model(x, w, fail_in, rank == failing_rank)
        return graph, out

    def captures_again():
        graph, out = capture()
        replays_match_eager(lambda: x.copy_(torch.randn_like(x)), graph.replay, lambda: model(x, w, None, False), out)
        graph.reset()

    for fail_in, own in (("segment", bg.UncapturableOpError), ("break", Simulated)):
        try:
            capture(fail_in)
        except own:
            assert rank == failing_rank, f"rank {rank} raised the failing rank's own error"
        except bg.PeerCaptureError as error:
            assert rank != failing_rank and error.ranks == (failing_rank,) and not error.out_of_step, error
        else:
            raise AssertionError(f"a failure in a {fail_in} did not raise on rank {rank}")
        captures_again()
        say(f"a failure in a {fail_in} on rank {failing_rank}: raised on every rank, the next capture replays right")

    try:
        capture(tag=rank % 2)  # two tags: say, two batch sizes
    except bg.PeerCaptureError as error:
        assert error.out_of_step and not error.ranks, error
    else:
        raise AssertionError("ranks with different tags kept their captures")
    captures_again()
    say("different tags: out_of_step on every rank, the next capture replays right")
    passed()


if __name__ == "__main__":
    main()
