"""Tensor parallelism on real GPUs: every program in ``tests/gpu/ranks/`` under torchrun, at 2 and 4 GPUs.

Each program runs its checks on every rank and leaves one ``rank<r>.passed``
file per rank at its end; a run is bounded by a timeout, so a rank left waiting fails
the test rather than hanging it. Skipped where the machine has fewer GPUs.
"""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = sorted(path.stem for path in (Path(__file__).parent / "ranks").glob("*.py") if not path.stem.startswith("_"))
WORLDS = (2, 4)
TIMEOUT_S = 240  # above the programs' own STALLED_S, so that a stalled rank's stack is in the log
# NVLink multicast off in NCCL, torch's symmetric memory and NVSHMEM: it can take a shared host's GPUs down.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_every_program_is_found():
    assert {"collectives", "failures", "runner"} <= set(PROGRAMS)


@pytest.mark.parametrize("world", WORLDS, ids=lambda world: f"{world}gpus")
@pytest.mark.parametrize("program", PROGRAMS)
def test_program_passes_on_every_rank(program, world, tmp_path):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs, this machine has {torch.cuda.device_count()}")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
        "--master-port", str(_free_port()), "--module", f"tests.gpu.ranks.{program}", str(tmp_path),
    ]
    environment = os.environ | NO_MULTICAST | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    # A session of its own, so that a run past the timeout is ended with every rank it started.
    launched = subprocess.Popen(command, cwd=ROOT, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = launched.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(launched.pid, signal.SIGKILL)
        log, _ = launched.communicate()
        pytest.fail(f"{program} on {world} GPUs ran past {TIMEOUT_S} s (a rank left waiting?):\n{log[-8000:]}")
    assert launched.returncode == 0, f"{program} on {world} GPUs failed:\n{log[-8000:]}"
    passed = sorted(path.name for path in tmp_path.glob("rank*.passed"))
    assert passed == sorted(f"rank{rank}.passed" for rank in range(world)), log[-8000:]
