"""Programs started on several GPUs under torchrun, bounded by a timeout that ends every rank.

torchrun's workers outlive a parent killed at a timeout, so each launch runs in
a process session of its own and the whole session is killed. NVLink
multicast stays off (it can take a shared host's GPUs down).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun(target: list[str], world: int, cwd: Path, timeout_s: float, env: dict | None = None) -> tuple[int | None, str]:
    """Run ``target`` (a script and its arguments, or ``--module name ...``) on ``world`` GPUs.

    Returns the exit status (None when it ran past ``timeout_s`` and was ended) and the
    merged output of every rank.
    """
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port", str(free_port()), *target]
    environment = (env or dict(os.environ)) | NO_MULTICAST
    launched = subprocess.Popen(command, cwd=cwd, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = launched.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(launched.pid, signal.SIGKILL)
        log, _ = launched.communicate()
        return None, log
    return launched.returncode, log
