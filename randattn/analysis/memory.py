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

import tracemalloc
import weakref
from typing import Any, Callable

__all__ = ["measure_peak"]


def _storage_tracker():
    """A ``TorchDispatchMode`` that tracks live and peak bytes of the storages its operators return."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from torch.utils.weak import WeakIdKeyDictionary

    class StoragePeak(TorchDispatchMode):
        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            # nothing here is compiled; skipping would import torch._dynamo (about a second) on first use
            return False

        def __init__(self) -> None:
            super().__init__()
            self.seen = WeakIdKeyDictionary()
            self.sizes: dict[weakref.ref, int] = {}
            self.current = 0
            self.peak = 0

        def _free(self, ref: weakref.ref) -> None:
            self.current -= self.sizes.pop(ref, 0)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if not isinstance(t, torch.Tensor):
                    continue
                st = t.untyped_storage()
                if st in self.seen:
                    continue
                # a storage first seen here was allocated by this operator (views and in-place results
                # share their input's storage, which is seen already or predates the measurement)
                nbytes = st.nbytes()
                self.seen[st] = True
                self.sizes[weakref.ref(st, self._free)] = nbytes
                self.current += nbytes
                self.peak = max(self.peak, self.current)
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
