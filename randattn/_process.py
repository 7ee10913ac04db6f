"""Process-wide settings that a computing process (the CLI, a Dask worker) opts into; never set on import.

:func:`retain_freed_memory` -- why: the sweep allocates and frees blocks of hundreds of MB
(R x heads x N x M probability blocks) many times a second. glibc serves every allocation above
its mmap threshold (at most 32 MiB) with a fresh ``mmap`` and returns it on ``free``, so each
block is page-faulted in and zeroed by the kernel again: on the 2-core benchmark machine that
was 33 s of system time in a 47 s sweep (W1, one 785-token image-layer). Keeping freed memory
in the heap makes the next block reuse the same pages (1 s of system time, 22 s wall).

The price is memory: the process does not shrink between blocks, and a block does not always fit
the pages that blocks of other shapes freed, so its resident peak can exceed the peak working set.
Blocks of growing size are computed largest first (a unit's query blocks:
:func:`randattn.analysis.query_blocks.largest_first`), and a run that splits a unit to fit its memory
budget does without the kept memory (``retain_freed_memory(False)``): there the budget, not the speed,
is what was asked for (RA on six 577-token heads, R = 16, under a 3 GiB budget: 2.4 GiB and 19-20 s
without, 4.6-4.9 GiB and 12 s with).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["retain_freed_memory"]

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
#: glibc's defaults (malloc/malloc.c: DEFAULT_MMAP_MAX, DEFAULT_TRIM_THRESHOLD)
_DEFAULT_MMAP_MAX = 65536
_DEFAULT_TRIM_THRESHOLD = 128 * 1024


def retain_freed_memory(keep: bool = True) -> bool:
    """Ask glibc's allocator to keep freed memory for reuse instead of returning it to the kernel (``keep``), or
    to return it again (``keep=False``).

    ``keep`` sets ``M_MMAP_MAX = 0`` (large blocks come from the heap, not from fresh mappings) and a
    trim threshold of 2 GiB (freed heap memory below it is not given back). The same as starting the
    process with ``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=...``; allocations made before the
    call are unaffected. ``keep=False`` sets glibc's defaults back (65,536 mappings, a trim threshold of
    128 KiB) and gives back what is free now (``malloc_trim(0)``).

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
    if not keep:
        applied = bool(libc.mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD))
        libc.malloc_trim.argtypes = (ctypes.c_size_t,)
        libc.malloc_trim(0)
        return applied
    # mallopt takes an int: 2**31 - 1 bytes is the largest trim threshold it can express
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
