"""Process-wide switches read from the environment, and the CUDA availability probe."""

from __future__ import annotations

import functools
import os

import torch

_TRUE = {"1", "true", "yes", "on"}


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def debug_requested(explicit: bool | None = None) -> bool:
    """``explicit`` when given, else ``BREAKGRAPH_DEBUG=1``."""
    return _env_flag("BREAKGRAPH_DEBUG") if explicit is None else bool(explicit)


def capture_disabled() -> bool:
    """``BREAKGRAPH_DISABLE=1``: callable forms run eagerly (an A/B switch)."""
    return _env_flag("BREAKGRAPH_DISABLE")


@functools.cache
def cuda_available() -> bool:
    """True when torch sees a GPU and cuda-python can talk to its driver."""
    if not torch.cuda.is_available():
        return False
    from bindings import device_count

    return device_count() > 0
