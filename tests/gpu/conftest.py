"""Every test in this folder needs a CUDA GPU: marked here, skipped cleanly without one
(tests/conftest.py), and selected on a GPU machine with ``pytest -m gpu``."""

from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)  # before tests/conftest.py skips what is marked gpu
def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(item.fspath).parents:
            item.add_marker(pytest.mark.gpu)
