"""Process-wide settings that a computing process (the CLI, a Dask worker) opts into; never set on import.

:func:`retain_freed_memory` -- why: the sweep allocates and frees blocks of hundreds of MB
(R x heads x N x M probability blocks) many times a second. glibc serves every allocation above
its mmap threshold (at most 32 MiB) with a fresh ``mmap`` and returns it on ``free``, so each
block is page-faulted in and zeroed by the kernel again: on the 2-core benchmark machine that
was 33 s of system time in a 47 s sweep (W1, one 785-token image-layer). Keeping freed memory
in the heap makes the next block reuse the same pages (1 s of system time, 22 s wall). The
process does not shrink between blocks, and its resident peak is the peak working set only where
no block is larger than those before it: a larger one does not fit the pages the smaller ones
freed, and the heap grows past them. Blocks of growing size are therefore computed largest first
(a unit's query blocks: :func:`randattn.analysis.query_blocks.largest_first`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["retain_freed_memory"]

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def retain_freed_memory() -> bool:
    """Ask glibc's allocator to keep freed memory for reuse instead of returning it to the kernel.

    Sets ``M_MMAP_MAX = 0`` (large blocks come from the heap, not from fresh mappings) and a
    trim threshold of 2 GiB (freed heap memory below it is not given back). The same as starting the
    process with ``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=...``; allocations made before the
    call are unaffected.

    Returns
    -------
    bool
        True when applied; False where the C library is not glibc (macOS, Windows, musl), which
        keep their own policies.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # glibc only  # noqa: B018
    except (OSError, AttributeError):
        return False
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    # mallopt takes an int: 2**31 - 1 bytes is the largest trim threshold it can express
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
