"""The layer contracts in pyproject.toml hold, and a broken one fails (import-linter)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = shutil.which("lint-imports")
pytestmark = pytest.mark.skipif(LINT is None, reason="import-linter is not installed (pip install -e '.[test]')")


def lint(root: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(root))
    return subprocess.run([LINT], cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_the_contracts_are_kept():
    run = lint(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout


@pytest.mark.parametrize(
    "path, line, broken",
    [
        ("breakgraph_bindings/graph.py", "import torch", "bindings talks to cuda-python only"),
        ("breakgraph/recording/segments.py", "import breakgraph.graphs.graph", "engine layers"),
        ("breakgraph/recording/segments.py", "import breakgraph.recording.recorder", "recording: the recorder over breaks"),
        ("breakgraph/base/checks.py", "import breakgraph.base.options", "base: services over the checks"),
        ("breakgraph/base/runtime.py", "import tests.helpers", "library code never imports benchmarks or tests"),
        ("breakgraph/unlisted.py", "import breakgraph.base.trees", "engine layers"),
        ("benchmarks/decoder.py", "import breakable_cuda_graphs", "only benchmarks.peers imports Meta's library"),
        ("breakgraph/serving/runner.py", "import transformers", "only breakgraph.hf imports transformers"),
    ],
)
def test_a_deliberately_broken_contract_fails(tmp_path, path, line, broken):
    # The tree as it installs: the folder bindings/ is the package breakgraph_bindings.
    for folder, package in (("breakgraph",) * 2, ("bindings", "breakgraph_bindings"), ("benchmarks",) * 2, ("tests",) * 2):
        shutil.copytree(ROOT / folder, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with open(tmp_path / path, "a") as source:
        source.write(f"\n{line}  # deliberately against the contract\n")
    run = lint(tmp_path)
    assert run.returncode != 0
    assert f"{broken}" in run.stdout and "BROKEN" in run.stdout.split(broken, 1)[1].splitlines()[0]
