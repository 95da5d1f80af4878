"""A rank whose process dies mid-capture: the others raise ``PeerCaptureError(lost=True)`` within
the runner's ``peer_timeout`` rather than wait forever.

The dying rank leaves with exit status 0, so that torchrun lets the others
run on to raise (a failed status would make torchrun stop them, which ends
the job too, but shows nothing of breakgraph).
"""

import os
import time

import torch
import torch.distributed as dist

import breakgraph as bg
from tests.gpu.ranks._ranks import mark_passed, start
from tests.helpers import scale_eager

PEER_TIMEOUT_S = 20
BOUND_S = PEER_TIMEOUT_S + 15  # the timeout, and the slack of a loaded host


def main() -> None:
    rank, world = start()
    dying = world - 1
    w = torch.randn(64, 64, device="cuda") / 8

    def step(x):
        h = x @ w
        dist.all_reduce(h)
        if rank == dying and bg.is_capturing():
            mark_passed()  # its part is to die here, in the capture's first segment
            os._exit(0)
        return scale_eager(h) @ w

    runner = bg.GraphRunner(step, torch.zeros(4, 64, device="cuda"), [4], group=dist.group.WORLD, peer_timeout=PEER_TIMEOUT_S, progress=False)
    started = time.monotonic()
    try:
        runner.capture()
    except bg.PeerCaptureError as error:
        waited = time.monotonic() - started
        assert error.lost, error
        assert waited < BOUND_S, f"rank {rank} raised after {waited:.1f} s, past {BOUND_S} s"
        print(f"[rank {rank}] raised PeerCaptureError(lost=True) {waited:.1f} s after the capture began", flush=True)
    else:
        raise AssertionError(f"rank {rank} kept a capture its peer died in")
    mark_passed()
    os._exit(0)  # a process group with a dead peer cannot be left in order


if __name__ == "__main__":
    main()
