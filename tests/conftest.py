import pytest
import torch


def _cuda_usable() -> bool:
    if not torch.cuda.is_available():
        return False
    from bindings import device_count

    return device_count() > 0


def pytest_collection_modifyitems(config, items):
    if _cuda_usable():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
