"""The one conversion of input arrays (q, k, v) to torch tensors: a unit's, and those given to ``randattn.estimate``.

On the torch backend a unit's inputs are read-only views of the activation file's arrays
(:meth:`~randattn.analysis.exact_cache.ExactCache.inputs`: no copy of a long context's keys and values), and
:meth:`~randattn.activations.io.Activations.qkv` gives a user read-only arrays too. torch has
no read-only tensors and warns, once per process, when it shares the memory of a read-only array; the engine
never writes its inputs, so that warning says nothing a user can act on and is silenced here, for these
conversions only.
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["input_tensor"]

_READ_ONLY_WARNING = "The given NumPy array is not writable"


def input_tensor(array: Any, *, device: Any = None, dtype: Any = None) -> Any:
    """``torch.as_tensor(array, device=device, dtype=dtype)`` for a unit's input ``array`` (shared, not copied,
    where the dtype and device allow), without torch's warning for a read-only array."""
    import torch

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_READ_ONLY_WARNING, category=UserWarning)
        return torch.as_tensor(array, device=device, dtype=dtype)
