"""Raw addresses, as LLM-DataDist takes them (``tensor.data_ptr()``), made safe.

An address is accepted only if ``[addr, addr + size)`` lies inside readable and
writable mappings of this process (``/proc/self/maps``), so a wrong address is
``LLMException(LLM_PARAM_INVALID)``, never a crash. The memory then stays the
caller's: it must outlive the registration, as in LLM-DataDist.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._types import LLMException, LLMStatusCode

__all__ = ["writable_ranges", "check_range", "view_at"]


def writable_ranges() -> list[tuple[int, int]]:
    """This process's readable+writable mappings, adjacent ones merged: ``[(start, end)]``."""
    out: list[tuple[int, int]] = []
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split(None, 2)[:2]
            if perms[:2] != "rw":
                continue
            lo, hi = (int(x, 16) for x in span.split("-"))
            if out and out[-1][1] == lo:
                out[-1] = (out[-1][0], hi)
            else:
                out.append((lo, hi))
    return out


def check_range(addr: Any, size: int, what: str, ranges: list[tuple[int, int]] | None = None) -> int:
    """``addr`` as an int, if ``size`` bytes from it are mapped writable here; else LLM_PARAM_INVALID."""
    if isinstance(addr, bool) or not isinstance(addr, (int, np.integer)):
        raise LLMException(f"{what} must be an int address (tensor.data_ptr()), got {type(addr).__name__}",
                           LLMStatusCode.LLM_PARAM_INVALID)
    a = int(addr)
    if a <= 0 or a + size > 2**64:
        raise LLMException(f"{what} {a:#x} is not a valid address", LLMStatusCode.LLM_PARAM_INVALID)
    for lo, hi in (ranges if ranges is not None else writable_ranges()):
        if lo <= a and a + size <= hi:
            return a
    raise LLMException(f"{what} [{a:#x}, {a + size:#x}) is not writable memory of this process "
                       f"(/proc/self/maps); a device address? kvengine moves host memory: "
                       f"use CPU tensors", LLMStatusCode.LLM_PARAM_INVALID)


def view_at(addr: int, size: int) -> NDArray[np.uint8]:
    """A writable uint8 numpy view of ``size`` bytes at a checked address."""
    buf = (ctypes.c_ubyte * size).from_address(addr)
    view: NDArray[np.uint8] = np.ctypeslib.as_array(buf)
    return view
