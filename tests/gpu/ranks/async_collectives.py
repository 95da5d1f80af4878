"""Async NCCL collectives (``async_op=True``) in captures, on every rank.

torch forks NCCL's own stream from the current one, and joins it back at
``work.wait()``, in C++, where breakgraph's hooks do not see. Under each capture
error mode: a collective waited on in the segment that launched it is captured,
and 20 replays on fresh inputs match eager; one waited on only after a break
leaves that stream forked where the segment ends, so the capture raises
``StreamJoinError`` at the break on every rank, and the next capture works.
"""

import torch
import torch.distributed as dist

import breakgraph as bg
from tests.gpu.ranks._ranks import passed, replays_match_eager, say, start
from tests.helpers import scale_eager

ROWS, HIDDEN = 8, 64


def waited_in_the_segment(x, w):
    h = x @ w
    work = dist.all_reduce(h, async_op=True)
    local = torch.tanh(x) @ w  # overlaps the collective
    work.wait()
    return scale_eager(h + local)  # a break after the wait


def waited_after_a_break(x, w):
    h = x @ w
    work = dist.all_reduce(h, async_op=True)
    local = scale_eager(x)  # a break while NCCL's stream is forked
    work.wait()
    return h + local


def main() -> None:
    rank, _ = start()
    torch.manual_seed(rank)  # each rank its own weights and inputs: the collective mixes them
    w = torch.randn(HIDDEN, HIDDEN, device="cuda") / HIDDEN**0.5
    x = torch.randn(ROWS, HIDDEN, device="cuda")
    for mode in ("global", "thread_local", "relaxed"):
        waited_in_the_segment(x, w)  # warm up NCCL and cuBLAS outside the capture
        torch.cuda.synchronize()
        graph = bg.BreakableCUDAGraph()
        with bg.BreakableCUDAGraphCapture(graph, capture_error_mode=mode):
            out = waited_in_the_segment(x, w)
        replays_match_eager(refill=lambda: x.copy_(torch.randn_like(x)), replay=graph.replay, eager=lambda: waited_in_the_segment(x, w), output=out)
        say(f"waited in the segment under {mode!r}: {graph.num_graphs} graphs, 20 replays match eager")
        graph.reset()

        waited_after_a_break(x, w)
        torch.cuda.synchronize()
        refused = bg.BreakableCUDAGraph()
        try:
            with bg.BreakableCUDAGraphCapture(refused, capture_error_mode=mode):
                waited_after_a_break(x, w)
        except bg.StreamJoinError as error:
            assert str(error).startswith("the segment before scale_eager() cannot end"), error
        else:
            raise AssertionError(f"a collective waited on after a break was captured under {mode!r}")
        assert not refused.captured
        say(f"waited after a break under {mode!r}: refused at the break")
    passed()


if __name__ == "__main__":
    main()
