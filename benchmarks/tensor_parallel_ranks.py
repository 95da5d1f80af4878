"""What the ranks of ``tensor_parallel`` do together: join the group, and meet a failure alike.

Every rank runs the same work in the same order, so that the collectives pair.
A rank that raised alone would pair its next collective with the others' next
step and leave them waiting, so a failure is shared: every rank learns of it
and reports it, and the run goes on to its next part.
"""

from __future__ import annotations

import os
import socket
import sys
import traceback

import torch
import torch.distributed as dist

from benchmarks.decoder import TensorParallel


class RanksFailed(Exception):
    """A failure every rank raises alike; its message names the rank it came from."""


def on_every_rank(work, tp: TensorParallel, whole_traceback: bool = False) -> tuple[object, str | None]:
    """``(work(), None)`` where it succeeded on every rank, else ``(None, why)`` on every rank: the
    first line of the first failed rank's error, and that rank. A rank that fails says so on
    stderr (the whole traceback if ``whole_traceback``). Ranks that fail at different points
    may leave the others waiting in a collective, until the process group's timeout."""
    result, error = None, None
    try:
        result = work()
    except Exception as caught:  # reported in the table; the run goes on
        first = (str(caught).strip().splitlines() or [""])[0]
        error = first if isinstance(caught, RanksFailed) else f"{type(caught).__name__}: {first} (rank {tp.rank})"
        print(f"[rank {tp.rank}] {traceback.format_exc() if whole_traceback else error}", file=sys.stderr, flush=True)
    failed = torch.zeros(1, device="cuda")
    failed += error is not None
    dist.all_reduce(failed, group=tp.group)
    if not failed.item():
        return result, None
    errors = [None] * tp.world
    dist.all_gather_object(errors, error, group=tp.group)
    return None, next(why for why in errors if why is not None)


def checked_on_every_rank(check, tp: TensorParallel):
    """``check()``'s result, or its failure raised on every rank: a rank that raised alone would
    pair its next collective with the others' next step. ``check`` must run every collective
    before it raises."""
    result, why = on_every_rank(check, tp, whole_traceback=True)
    if why is not None:
        raise RanksFailed(why)
    return result


def start() -> TensorParallel:
    """Join the NCCL process group on this rank's GPU: torchrun's, or a group of one."""
    local = int(os.environ.get("LOCAL_RANK", 0))
    if local >= torch.cuda.device_count():
        print(f"python3 -m benchmarks.tensor_parallel: rank {local} of this host has no GPU of its own "
              f"({torch.cuda.device_count()} visible): start at most that many ranks; nothing was measured", file=sys.stderr)
        raise SystemExit(2)
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    if "RANK" in os.environ:  # torchrun's
        dist.init_process_group("nccl", device_id=device)
    else:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0, device_id=device)
    return TensorParallel(dist.get_rank(), dist.get_world_size(), dist.group.WORLD)
