"""CUDA status codes turned into exceptions that carry the error's name and text."""

from __future__ import annotations

from cuda.bindings import driver
from cuda.bindings import runtime as cudart

_SUCCESS = cudart.cudaError_t.cudaSuccess


class CudaError(RuntimeError):
    """A CUDA runtime call failed.

    ``code`` is the numeric ``cudaError_t``, ``name`` its enum name
    (``cudaErrorStreamCaptureUnsupported``) and ``text`` CUDA's description.
    """

    def __init__(self, code: int, call: str = "", context: str = "", *, name: str | None = None, text: str | None = None):
        self.code = int(code)
        self.name = name or _error_name(code)
        self.text = text or _error_text(code)
        self.call = call
        where = f"{call}: " if call else ""
        extra = f" ({context})" if context else ""
        super().__init__(f"{where}{self.name}: {self.text}{extra}")


def _error_name(code: int) -> str:
    try:
        err, name = cudart.cudaGetErrorName(cudart.cudaError_t(int(code)))
    except ValueError:
        return f"cudaError({int(code)})"
    return name.decode() if err == _SUCCESS else f"cudaError({int(code)})"


def _error_text(code: int) -> str:
    try:
        err, text = cudart.cudaGetErrorString(cudart.cudaError_t(int(code)))
    except ValueError:
        return "unrecognized error code"
    return text.decode() if err == _SUCCESS else "unrecognized error code"


def check(result, call: str = ""):
    """Unpack a cuda.bindings result tuple ``(err, *values)``; raise on error.

    Returns ``None`` for no values, the value for one, a tuple for several.
    """
    err = result[0]
    if err != _SUCCESS:
        clear_last_error()
        raise CudaError(err, call)
    if len(result) == 2:  # one value, the common case, without a call (a capture checks a few a break)
        return result[1]
    return values_of(result)


def values_of(result):
    """What follows the status in a cuda.bindings result tuple: ``None`` for nothing, the
    value for one, a tuple for several."""
    if len(result) == 1:
        return None
    if len(result) == 2:
        return result[1]
    return result[1:]


def clear_last_error() -> None:
    """Consume the runtime's last-error slot so a handled failure is not
    reported again by the next library that checks ``cudaGetLastError``."""
    try:
        cudart.cudaGetLastError()
    except Exception:  # no driver: nothing to clear
        pass


def check_driver(result, call: str = ""):
    """:func:`check` for a driver API call (``cuda.bindings.driver``), whose codes and names
    are the driver's (``CUDA_ERROR_INVALID_VALUE``)."""
    err = result[0]
    if err != driver.CUresult.CUDA_SUCCESS:
        clear_last_error()
        _, name = driver.cuGetErrorName(err)
        _, text = driver.cuGetErrorString(err)
        raise CudaError(err, call, name=(name or b"").decode() or None, text=(text or b"").decode() or None)
    return values_of(result)
