"""Several threads capturing at once on one device, under each capture mode that lets them and
each way of treating random ops; every replay checked against eager, 20 rounds in a row."""

import itertools

import pytest

from tests.gpu.threads import Body, Worker, capture_concurrently

pytestmark = pytest.mark.gpu

BODIES = {
    "plain": Body(),
    "dropout": Body(dropout=True),
    "side stream": Body(side_stream=True),
    "dropout and side stream": Body(dropout=True, side_stream=True),
}


@pytest.mark.parametrize(
    "threads, mode, random_ops, body",
    list(itertools.product([2, 4], ["thread_local", "relaxed"], ["graph", "break"], BODIES)),
)
def test_threads_capture_at_once_and_replay_like_eager(threads, mode, random_ops, body):
    workers = [Worker(index) for index in range(threads)]
    capture_concurrently(workers, BODIES[body], mode, random_ops, rounds=20)


def test_threads_capture_at_once_in_debug_mode():
    workers = [Worker(index) for index in range(2)]
    capture_concurrently(workers, BODIES["dropout and side stream"], "thread_local", "graph", rounds=5, debug=True)


def test_new_threads_capture_while_torch_hands_its_pooled_streams_out_again():
    """torch hands out its 32 pooled streams per device round robin, so a stream a new thread
    takes can be the one another thread is capturing on. Fresh threads every round, the pool
    advanced one stream further each time, so every alignment comes up: nothing breakgraph
    takes for itself may collide with a worker's capture stream."""
    import torch

    workers = [Worker(index) for index in range(2)]
    kept_alive = []
    for _ in range(40):
        capture_concurrently(workers, BODIES["dropout and side stream"], "thread_local", "graph")
        kept_alive.append(torch.cuda.Stream())
