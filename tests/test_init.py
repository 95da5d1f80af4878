"""The package's public names."""

import breakgraph as bg


def test_public_names():
    for name in [
        "BreakableCUDAGraph",
        "BreakableCUDAGraphCapture",
        "GraphRunner",
        "break_graph",
        "eager_on_graph",
        "graphed",
        "is_capturing",
    ]:
        assert hasattr(bg, name)
    assert set(bg.__all__) <= set(dir(bg))


def test_the_version_is_the_installed_distributions():
    import importlib.metadata
    import re

    assert re.fullmatch(r"\d+\.\d+\.\d+", bg.__version__)
    assert importlib.metadata.version("breakgraph") == bg.__version__


def test_import_is_quiet_in_a_fresh_process():
    """No warning on import (torch's 'Failed to initialize NumPy' included: numpy is a dependency)."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-W", "error", "-c", "import breakgraph"], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout == "" and run.stderr == "", run.stderr
