r"""Peak working memory of a computation: numpy buffers (tracemalloc) plus torch tensors.

:func:`measure_peak` is how the sweep calibrates the bytes one (cell, replicate) of a unit needs
(:mod:`randattn.analysis.execute`), on the very code path that then runs -- the batched torch
form on the torch backend, the numpy reference otherwise. numpy reports its buffers to
tracemalloc; torch does not, so torch tensors are counted by a dispatch mode that sees every
tensor an operator returns and follows its storage until it is freed (the technique of
``torch.distributed._tools.mem_tracker``, whose package takes over a second to import).

The two peaks are added: an upper bound on the joint peak.
"""

from __future__ import annotations

import functools
import sys
import tracemalloc
import weakref
from typing import Any, Callable

__all__ = ["DEFAULT_BUDGET_FRACTION", "allocation_failure", "available_memory", "default_max_memory", "limit_headroom",
           "measure_peak"]

#: the share of the device's free memory that ``randattn mse`` gives the estimator work unless told otherwise
#: (``--max-memory``): the rest is left to the activations, the interpreter and the other processes of the machine
DEFAULT_BUDGET_FRACTION = 0.5

#: what :func:`available_memory` assumes where it cannot ask the system (no ``/proc/meminfo``, no ``sysconf``)
_FALLBACK_AVAILABLE = 4 * 2**30


def allocation_failure(exc: BaseException) -> str | None:
    """What did not fit, when ``exc`` is a failed allocation (its first line, e.g. numpy's ``"Unable to allocate
    66.4 GiB for an array with shape ..."``); None for any other error.

    numpy raises :class:`MemoryError` and torch's CUDA allocator ``torch.cuda.OutOfMemoryError``; torch's CPU allocator
    raises a plain ``RuntimeError`` (``"DefaultCPUAllocator: can't allocate memory: ..."``, c10 gives it no type
    of its own), which is known by its text: it names memory and allocating, or being out of it.
    """
    text = str(exc)
    torch = sys.modules.get("torch")  # only an error torch raised can be torch's: it is imported then
    if isinstance(exc, MemoryError) or isinstance(exc, getattr(getattr(torch, "cuda", None), "OutOfMemoryError", ())):
        return (text.splitlines() or [""])[0] or "an allocation failed"
    lowered = text.lower()
    if isinstance(exc, RuntimeError) and "memory" in lowered and ("allocate" in lowered or "out of" in lowered):
        return text.splitlines()[0]
    return None


def available_memory(device: str | None = None) -> int:
    """Bytes free for new work on ``device``: ``torch.cuda.mem_get_info`` on a CUDA device; else the host's
    ``MemAvailable`` (``/proc/meminfo``, Linux), else its free pages (``sysconf``), else 4 GiB -- and no more than
    this process's cgroup may still take (:func:`limit_headroom`: a container's or a batch job's allotment), which
    the host's figures do not see."""
    if device is not None and str(device).startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    host = _host_available()
    headroom = limit_headroom()
    return host if headroom is None else min(host, headroom)


def _host_available() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the kernel says kB, meaning KiB
    except (OSError, ValueError, IndexError):
        pass
    import os

    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, OSError, ValueError):
        return _FALLBACK_AVAILABLE


#: cgroup v1 writes "no limit" as the largest page-aligned signed 64-bit number (or near it)
_NO_CGROUP_LIMIT = 2**62


def limit_headroom(cgroup_root: str = "/sys/fs/cgroup", proc_self: str = "/proc/self") -> int | None:
    """Bytes this process's cgroup may still take: its memory limit less its usage (v2 ``memory.max`` -
    ``memory.current``, or v1 ``memory.limit_in_bytes`` - ``memory.usage_in_bytes``), the allotment of a container
    or a Slurm job, where ``MemAvailable`` shows the whole host and a budget from it ends in the kernel's OOM kill
    (SIGKILL, no message). None where no limit is set or readable (not Linux); 0 at the least.

    An address-space limit (``ulimit -v``) is not counted: torch and pyarrow reserve far more address space than
    they touch, so a budget from it says little, and a run under it ends with the allocator's error (exit 2)."""
    import os

    v2, v1 = _cgroup_paths(proc_self)
    # the process's own cgroup first, then the mount's root (a container sees its own cgroup as the root)
    for base, group, limit_file, usage_file in ((cgroup_root, v2, "memory.max", "memory.current"),
                                                (os.path.join(cgroup_root, "memory"), v1, "memory.limit_in_bytes",
                                                 "memory.usage_in_bytes")):
        for folder in dict.fromkeys([os.path.join(base, group.lstrip("/")), base]):
            limit, usage = _read_int(os.path.join(folder, limit_file)), _read_int(os.path.join(folder, usage_file))
            if limit is not None and usage is not None and limit < _NO_CGROUP_LIMIT:
                return max(0, limit - usage)
    return None


def _cgroup_paths(proc_self: str) -> tuple[str, str]:
    """This process's cgroup paths in ``/proc/self/cgroup``: v2 (its ``0::`` line) and v1's memory controller (its
    ``:memory:`` line); "/" for one that is absent."""
    v2 = v1 = "/"
    try:
        with open(f"{proc_self}/cgroup") as fh:
            for line in fh:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers == "":
                    v2 = path or "/"
                elif "memory" in controllers.split(","):
                    v1 = path or "/"
    except (OSError, ValueError):
        pass
    return v2, v1


def _read_int(path: str) -> int | None:
    """The integer a cgroup file holds; None where it is absent, unreadable or "max" (v2's no limit)."""
    try:
        with open(path) as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def default_max_memory(device: str | None = None) -> int:
    """The default budget: :data:`DEFAULT_BUDGET_FRACTION` of :func:`available_memory` on ``device``."""
    return int(DEFAULT_BUDGET_FRACTION * available_memory(device))


def _storage_tracker():
    """A ``TorchDispatchMode`` that tracks live and peak bytes of the storages its operators return.

    It runs on every operator of the measured call, so it is kept lean: a storage is keyed by its
    ``id`` while it lives (torch keeps one Python object per storage for the storage's whole life, so
    the id is stable, and the weak reference's callback drops the key before the id can be reused),
    and the common results -- a tensor, a tuple or list of tensors -- skip the generic pytree walk.
    Before, with a ``WeakIdKeyDictionary`` beside a second weak reference per storage and a pytree walk
    of every result, the demo's memory calibration (its estimators and S at 197, 577 and 785 tokens)
    took 6.9 s on 2 cores; now 5.7 s, of which 2.0 s is the calibrated code itself and the rest this
    mode's dispatch and tracemalloc's tracing of it. The counts are the same.
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    tensor_type = torch.Tensor

    class StoragePeak(TorchDispatchMode):
        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            # nothing here is compiled; skipping would import torch._dynamo (about a second) on first use
            return False

        def __init__(self) -> None:
            super().__init__()
            self.live: dict[int, tuple[weakref.ref, int]] = {}  # id(storage) -> (weak reference, bytes)
            self.current = 0
            self.peak = 0

        def _track(self, t) -> None:
            st = t.untyped_storage()
            key = id(st)
            if key in self.live:
                return
            # a storage first seen here was allocated by this operator (views and in-place results
            # share their input's storage, which is seen already or predates the measurement)
            nbytes = st.nbytes()
            self.live[key] = (weakref.ref(st, functools.partial(self._free, key)), nbytes)
            self.current += nbytes
            if self.current > self.peak:
                self.peak = self.current

        def _free(self, key: int, ref: weakref.ref) -> None:
            entry = self.live.get(key)
            if entry is not None and entry[0] is ref:
                del self.live[key]
                self.current -= entry[1]

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, tensor_type):
                self._track(out)
            elif isinstance(out, (tuple, list)) and all(isinstance(t, tensor_type) or t is None for t in out):
                for t in out:
                    if t is not None:
                        self._track(t)
            else:
                for t in tree_leaves(out):
                    if isinstance(t, tensor_type):
                        self._track(t)
            return out

    return StoragePeak()


def measure_peak(func: Callable[[], Any], *, torch_tensors: bool = False) -> int:
    """Peak bytes allocated while ``func()`` runs, above what was allocated before it (at least 1).

    Parameters
    ----------
    func : callable
        Called once, without arguments; its result is dropped.
    torch_tensors : bool
        Also count torch tensors (any device) created by ``func``; their peak is added to numpy's.

    Notes
    -----
    A tensor that ``func`` makes from a numpy array without copying (``torch.from_numpy``) is
    counted once, by tracemalloc. Inputs that exist before the call are not counted.
    """
    tracker = _storage_tracker() if torch_tensors else None  # its imports before tracing starts
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    try:
        if tracker is None:
            func()
        else:
            with tracker:
                func()
        numpy_peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        if not was_tracing:
            tracemalloc.stop()
    return max(numpy_peak + (tracker.peak if tracker is not None else 0), 1)
