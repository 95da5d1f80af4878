"""``python -m breakgraph demo`` on a machine without a GPU: the eager path."""

import os
import subprocess
import sys

import pytest

from breakgraph.base.runtime import cuda_available


@pytest.mark.skipif(cuda_available(), reason="checks the no-GPU path")
def test_demo_runs_the_eager_path_without_a_gpu():
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    run = subprocess.run(
        [sys.executable, "-m", "breakgraph", "demo", "--iters", "2"], capture_output=True, text=True, env=env, timeout=300
    )
    assert run.returncode == 0, run.stderr
    assert "no CUDA GPU" in run.stdout and "(OK)" in run.stdout
    assert "Not checked: graph capture and replay" in run.stdout  # says what a CPU run cannot show
