"""What every rank program shares: start under torchrun, check replays against eager, report.

A rank program is a script under ``tests/gpu/ranks/`` that torchrun starts on
every rank (``tests/gpu/test_tensor_parallel.py`` launches each at 2 and 4
GPUs). It runs its checks in a row in one process group, so a check that left
the ranks out of step breaks the ones after it, and ends by calling
:func:`passed`: the launcher counts one ``rank<r>.passed`` file per rank in the
folder it passes as the program's argument.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tests.helpers import poison_

STALLED_S = 200  # under the launcher's timeout (tests/gpu/test_tensor_parallel.py)


def start(timeout_s: float = 120) -> tuple[int, int]:
    """Join the NCCL process group on this rank's GPU; return (rank, world size).

    A rank left waiting in a collective fails the program after ``timeout_s``
    (NCCL's watchdog) instead of hanging it: the launcher's own timeout is the last word.
    """
    # A rank still running after STALLED_S prints every thread's stack and ends: the launcher's log
    # then shows where it waited.
    faulthandler.dump_traceback_later(STALLED_S, exit=True)
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", timeout=timedelta(seconds=timeout_s), device_id=torch.device("cuda", torch.cuda.current_device()))
    return dist.get_rank(), dist.get_world_size()


def say(*words) -> None:
    print(f"[rank {dist.get_rank()}]", *words, flush=True)


def same_on_every_rank(value: torch.Tensor) -> torch.Tensor:
    """``value`` (a CUDA tensor) taken from rank 0 on every rank: one random input for all."""
    dist.broadcast(value, 0)
    return value


def assert_same_on_every_rank(value: torch.Tensor, what: str) -> None:
    """Fail unless every rank holds exactly ``value``."""
    gathered = [torch.empty_like(value) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, value.contiguous())
    for rank, other in enumerate(gathered):
        assert torch.equal(other, value), f"{what}: rank {rank} differs from rank {dist.get_rank()}"


def replays_match_eager(refill, replay, eager, output, replays: int = 20, atol=1e-4, rtol=1e-4) -> None:
    """``replays`` times: fresh inputs (``refill()``), the output poisoned, ``replay()``, then
    compare ``output`` with ``eager()`` (run after, on the same inputs)."""
    for _ in range(replays):
        refill()
        poison_(output)
        replay()
        got = [tensor.clone() for tensor in _tensors(output)]
        expected = _tensors(eager())
        for index, (a, e) in enumerate(zip(got, expected)):
            torch.testing.assert_close(a, e, atol=atol, rtol=rtol, msg=lambda m: f"output {index}: {m}")


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [tensor for item in value for tensor in _tensors(item)]


def passed() -> None:
    """Say this rank passed, and leave the process group.

    Graphs that captured NCCL collectives must be gone first (dropped, or reset):
    NCCL does not end a communicator that a live graph still launches into.
    """
    gc.collect()
    torch.cuda.synchronize()
    dist.barrier()
    mark_passed()
    dist.destroy_process_group()
    sys.exit(0)


def mark_passed() -> None:
    """Leave this rank's mark in the launcher's folder (the program's argument)."""
    Path(sys.argv[1], f"rank{dist.get_rank()}.passed").touch()
    print(f"RANK {dist.get_rank()} PASSED", flush=True)
