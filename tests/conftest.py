from collections import Counter

import pytest

from breakgraph.base.runtime import cuda_available

NO_GPU = "needs a CUDA GPU"


def pytest_collection_modifyitems(config, items):
    if cuda_available():
        return
    skip = pytest.mark.skip(reason=NO_GPU)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """One line per reason tests were skipped, rather than one per test file: without a GPU
    the GPU suite's skips would bury everything else."""
    reasons = Counter(_skip_reason(report) for report in terminalreporter.stats.get("skipped", []))
    for reason, count in sorted(reasons.items(), key=lambda item: -item[1]):
        if reason == NO_GPU:
            reason = "no CUDA GPU is visible (the GPU suite: python3 -m pytest -m gpu on a GPU machine)"
        terminalreporter.write_line(f"skipped {count}: {reason}")


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    message = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return message.removeprefix("Skipped: ")
