"""Every Python block in README.md runs as written, pasted alone into a fresh interpreter, on the
machine its first line names: "Runs anywhere" blocks here (and on a GPU machine, where they
capture), "Needs a CUDA GPU" blocks on a GPU, "Needs 2 CUDA GPUs" blocks under torchrun."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from breakgraph.runtime import cuda_available

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```python\n(.*?)^```", README, flags=re.DOTALL | re.MULTILINE)
WHERE = {
    "# Runs anywhere": "anywhere",
    "# Needs a CUDA GPU": "gpu",
    "# Needs 2 CUDA GPUs": "2 gpus",
}


def where(block: str) -> str | None:
    first = block.splitlines()[0]
    return next((kind for prefix, kind in WHERE.items() if first.startswith(prefix)), None)


def blocks(kind: str) -> list:
    return [pytest.param(block, id=f"block{index}") for index, block in enumerate(BLOCKS) if where(block) == kind]


def run(block: str, tmp_path: Path, command: list[str] | None = None) -> None:
    script = tmp_path / "block.py"
    script.write_text(block)
    done = subprocess.run(
        command or [sys.executable, str(script)],
        cwd=tmp_path,  # a fresh folder: the block finds breakgraph as an installed user would
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"this README block failed:\n{block}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"


def test_every_python_block_says_where_it_runs():
    assert len(BLOCKS) >= 7  # the pattern found the blocks
    unlabelled = [block.splitlines()[0] for block in BLOCKS if where(block) is None]
    assert not unlabelled, f"blocks whose first line does not say where they run: {unlabelled}"


@pytest.mark.parametrize("block", blocks("anywhere"))
def test_a_block_that_runs_anywhere_runs_here(block, tmp_path):
    run(block, tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("block", blocks("gpu"))
def test_a_gpu_block_runs_on_a_gpu(block, tmp_path):
    run(block, tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(cuda_available() and torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("block", blocks("2 gpus"))
def test_a_two_gpu_block_runs_under_torchrun(block, tmp_path):
    torchrun = shutil.which("torchrun") or "torchrun"
    run(block, tmp_path, [torchrun, "--nproc-per-node", "2", str(tmp_path / "block.py")])
