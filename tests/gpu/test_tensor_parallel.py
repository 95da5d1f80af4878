"""Tensor parallelism on real GPUs: every program in ``tests/gpu/ranks/`` under torchrun, at 2 and 4 GPUs.

Each program runs its checks on every rank and leaves one ``rank<r>.passed``
file per rank at its end; a run is bounded by a timeout, so a rank left waiting
fails the test rather than hanging it (and prints its stack first, see
``ranks/_ranks.py``). Skipped where the machine has fewer GPUs.
"""

import os
from pathlib import Path

import pytest
import torch

from tests.launch import torchrun

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = sorted(path.stem for path in (Path(__file__).parent / "ranks").glob("*.py") if not path.stem.startswith("_"))
WORLDS = (2, 4)
TIMEOUT_S = 240  # above the programs' own STALLED_S, so that a stalled rank's stack is in the log


def test_every_program_is_found():
    assert {"collectives", "failures", "runner", "peer_dies", "hf_generate"} <= set(PROGRAMS)


@pytest.mark.parametrize("world", WORLDS, ids=lambda world: f"{world}gpus")
@pytest.mark.parametrize("program", PROGRAMS)
def test_program_passes_on_every_rank(program, world, tmp_path):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs, this machine has {torch.cuda.device_count()}")
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    status, log = torchrun(["--module", f"tests.gpu.ranks.{program}", str(tmp_path)], world, ROOT, TIMEOUT_S, os.environ | {"PYTHONPATH": path})
    assert status is not None, f"{program} on {world} GPUs ran past {TIMEOUT_S} s (a rank left waiting?):\n{log[-8000:]}"
    assert status == 0, f"{program} on {world} GPUs failed:\n{log[-8000:]}"
    passed = sorted(path.name for path in tmp_path.glob("rank*.passed"))
    assert passed == sorted(f"rank{rank}.passed" for rank in range(world)), log[-8000:]
