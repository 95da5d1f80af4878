"""torch's scaled dot-product attention on any backend but cuDNN's, the user's settings kept.

cuDNN's attention builds an execution plan on the host for every new shape it
meets, and keeps it for the next call of that shape. The break meets a new
shape at every decode step (the key length grows by one) and at every new
prompt length, so on cuDNN each step would first wait for a plan of its own,
far longer than the step itself takes. Flash, memory-efficient and math
attention run precompiled kernels for any length; torch picks among them as
the user's backend flags allow.

torch keeps those flags process-wide and takes no backend per call.
``torch.nn.attention.sdpa_kernel`` sets all of them at once, so it would turn
back on a backend the user turned off, and costs more than the one flag: the
cuDNN flag alone is turned off around the call and put back after it, even
when the call raises. Calls from several threads at once share one lock and
a count, so the user's setting comes back after the last of them; while any
runs, other SDPA calls in the process run without cuDNN too.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F


class _CudnnAttentionOff:
    """Context: cuDNN's attention off while any breakgraph attention runs; the setting found
    on entering the first back on leaving the last."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._user_setting = True

    def __enter__(self) -> None:
        with self._lock:
            if self._running == 0:
                self._user_setting = torch.backends.cuda.cudnn_sdp_enabled()
                torch.backends.cuda.enable_cudnn_sdp(False)
            self._running += 1

    def __exit__(self, *exception) -> None:
        with self._lock:
            self._running -= 1
            if self._running == 0:
                torch.backends.cuda.enable_cudnn_sdp(self._user_setting)


_CUDNN_OFF = _CudnnAttentionOff()


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **options) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention(query, key, value, **options)``, never on cuDNN."""
    with _CUDNN_OFF:
        return F.scaled_dot_product_attention(query, key, value, **options)
