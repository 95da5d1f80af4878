"""NCCL collectives in captures, on every rank: inside segments, as a break, and on a side stream.

Under each capture error mode, three programs are captured and replayed 20
times on fresh inputs against eager: ``all_reduce``, ``all_gather_into_tensor``
and ``reduce_scatter_tensor`` inside segments (a plain break between them); an
``all_reduce`` that is itself the break; and an ``all_reduce`` on a side stream
forked before a break and joined after it.
"""

import torch
import torch.distributed as dist

import breakgraph as bg
from tests.gpu.ranks._ranks import passed, replays_match_eager, say, start
from tests.helpers import scale_eager

ROWS, HIDDEN = 8, 64


def in_segments(x, w):
    h = x @ w
    dist.all_reduce(h)
    gathered = h.new_empty(dist.get_world_size() * h.shape[0], h.shape[1])
    dist.all_gather_into_tensor(gathered, torch.tanh(h))
    scaled = scale_eager(gathered)  # a break between the collectives
    out = torch.empty_like(h)
    dist.reduce_scatter_tensor(out, scaled @ w)
    return out + h


@bg.eager_on_graph
def summed(x):
    total = x.clone()
    dist.all_reduce(total)
    return total


def as_the_break(x, w):
    return torch.relu(summed(x @ w)) @ w


SIDE = None


def on_a_side_stream(x, w):
    SIDE.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(SIDE):
        side = torch.sin(x) @ w
        dist.all_reduce(side)
    main = scale_eager(x @ w)  # a break while the side stream's collective is not joined yet
    torch.cuda.current_stream().wait_stream(SIDE)
    return main + side


def main() -> None:
    global SIDE
    rank, world = start()
    SIDE = torch.cuda.Stream()
    torch.manual_seed(rank)  # each rank its own weights and inputs: the collectives mix them
    w = torch.randn(HIDDEN, HIDDEN, device="cuda") / HIDDEN**0.5
    x = torch.randn(ROWS, HIDDEN, device="cuda")
    for mode in ("global", "thread_local", "relaxed"):
        for program in (in_segments, as_the_break, on_a_side_stream):
            program(x, w)  # warm up NCCL and cuBLAS outside the capture
            torch.cuda.synchronize()
            graph = bg.BreakableCUDAGraph()
            with bg.BreakableCUDAGraphCapture(graph, capture_error_mode=mode):
                out = program(x, w)
            replays_match_eager(
                refill=lambda: x.copy_(torch.randn_like(x)),
                replay=graph.replay,
                eager=lambda: program(x, w),
                output=out,
            )
            say(f"{program.__name__} under {mode!r}: {graph.num_graphs} graphs, {graph.num_eager_breaks} breaks, 20 replays match eager")
            graph.reset()
    passed()


if __name__ == "__main__":
    main()
