"""Several threads capturing at once, each checking its replays against eager: shared by the
thread tests, the long-lived process tests and the random-programs property test."""

from __future__ import annotations

import gc
import threading
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

import breakgraph as bg
from tests.helpers import assert_close, poison_

DEV = "cuda"

# Checks that restore the default generator's state (replay, then eager on the same offsets)
# touch process-wide state: one thread at a time.
generator_lock = threading.Lock()


@bg.eager_on_graph
def scale_in_place(buf, factor):
    buf.mul_(factor)


@dataclass(frozen=True)
class Body:
    """What each thread captures: ``buf.copy_(x)``, a break that scales ``buf`` in place, then
    graph work; optionally a side stream's share of it, and dropout."""

    dropout: bool = False
    side_stream: bool = False

    def __call__(self, x, buf, factor, side):
        buf.copy_(x)
        scale_in_place(buf, factor)
        h = buf + 1.0
        if self.side_stream:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                s = torch.relu(h) * 0.5
            torch.cuda.current_stream().wait_stream(side)
            h = h + s
        if self.dropout:
            h = F.dropout(h, 0.5, training=True)
        return h

    def eager(self, x, factor):
        """The same computation as plain torch ops (dropout from the default generator)."""
        h = x * factor + 1.0
        if self.side_stream:
            h = h + torch.relu(h) * 0.5
        if self.dropout:
            h = F.dropout(h, 0.5, training=True)
        return h


class Worker:
    """One thread's stream, buffers and factor; :meth:`capture` and :meth:`check` its graph."""

    def __init__(self, index: int, width: int = 4096):
        self.index = index
        self.factor = 1.5 + index
        self.stream = torch.cuda.Stream()
        self.side = torch.cuda.Stream()
        # Fresh inputs come from a generator of this worker's own: draws from the default one
        # would move it between another worker's replay and its eager twin.
        self.inputs = torch.Generator(device=DEV).manual_seed(index)
        with torch.cuda.stream(self.stream):
            self.x = torch.randn(width, device=DEV)
            self.buf = torch.empty(width, device=DEV)
        self.stream.synchronize()

    def warm_up(self, body: Body, times: int = 3) -> None:
        with torch.cuda.stream(self.stream):
            for _ in range(times):
                body(self.x, self.buf, self.factor, self.side)
        self.stream.synchronize()

    def capture(self, body: Body, mode: str, random_ops: str, debug: bool = False) -> tuple:
        graph = bg.BreakableCUDAGraph(debug=debug)
        with bg.BreakableCUDAGraphCapture(graph, stream=self.stream, capture_error_mode=mode, random_ops=random_ops):
            out = body(self.x, self.buf, self.factor, self.side)
        return graph, out

    def check(self, body: Body, graph, out) -> None:
        """Replay on fresh input with a poisoned output, compared with eager on the same
        generator offsets. A body that draws random numbers is checked under
        :data:`generator_lock`, replay and eager twin both, until its stream is done: every
        graph that draws reads the generator's one seed/offset pair (torch 2.11)."""
        with torch.cuda.stream(self.stream):
            fresh = torch.randn(self.x.shape, device=DEV, generator=self.inputs)
            self.x.copy_(fresh)
            poison_(out)
        if body.dropout:
            with generator_lock, torch.cuda.stream(self.stream):
                state = torch.cuda.get_rng_state()
                graph.replay()
                torch.cuda.set_rng_state(state)
                expected = body.eager(fresh, self.factor)
                self.stream.synchronize()
        else:
            with torch.cuda.stream(self.stream):
                graph.replay()
                expected = body.eager(fresh, self.factor)
            self.stream.synchronize()
        assert_close(out, expected, 1e-5, 1e-5)


def run_together(tasks: list[Callable[[threading.Barrier], None]]) -> None:
    """Run each task on its own thread, all sharing one barrier to meet at; raise the first
    error any of them met (a broken barrier only when nothing else went wrong)."""
    barrier = threading.Barrier(len(tasks))
    errors: list[BaseException] = []
    # Earlier tests' garbage goes now: a collection that a new thread starts just before another
    # thread's capture begins runs on through it, and freeing CUDA memory there aborts the process.
    gc.collect()

    def guarded(task) -> None:
        try:
            task(barrier)
        except BaseException as error:  # re-raised below, with the others stopped
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=guarded, args=(task,)) for task in tasks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    real = [error for error in errors if not isinstance(error, threading.BrokenBarrierError)]
    if errors:
        raise (real or errors)[0]


def capture_concurrently(
    workers: list[Worker], body: Body, mode: str, random_ops: str, rounds: int = 1, debug: bool = False
) -> None:
    """Every worker on its own thread, ``rounds`` times in a row: meet, capture at once, meet,
    check two replays against eager, drop the graph."""

    def task(worker: Worker) -> Callable[[threading.Barrier], None]:
        def work(barrier: threading.Barrier) -> None:
            worker.warm_up(body)
            for _ in range(rounds):
                barrier.wait()
                graph, out = worker.capture(body, mode, random_ops, debug)
                barrier.wait()  # every capture has ended: the generator is nobody's
                for _ in range(2):
                    worker.check(body, graph, out)
                del graph, out

        return work

    run_together([task(worker) for worker in workers])
