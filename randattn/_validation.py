"""Input validation shared by every public function: one place, clear messages.

Errors name the argument, the value or shape received, and what is allowed. Nothing
here uses ``assert`` (it vanishes under ``python -O``).
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import numpy as np

__all__ = [
    "check_choice",
    "check_positive_int",
    "check_qkv_shapes",
    "check_scale",
    "default_scale",
]


def check_choice(name: str, value: Any, allowed: Iterable[Any]) -> Any:
    """Return ``value`` if it is one of ``allowed``, else raise ``ValueError`` listing them."""
    allowed = tuple(allowed)
    if value not in allowed:
        listed = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"{name}={value!r} is not allowed; choose one of {listed}")
    return value


def check_positive_int(name: str, value: Any, *, minimum: int = 1) -> int:
    """Return ``value`` as an int if it is an integer >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def default_scale(head_dim: int) -> float:
    """The ViT temperature ``D ** -0.5``."""
    return float(head_dim) ** -0.5


def check_scale(scale: Any, head_dim: int) -> float:
    """Return the attention temperature: ``scale`` or ``D ** -0.5`` when it is None."""
    if scale is None:
        return default_scale(head_dim)
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise TypeError(f"scale must be a positive real number, got {scale!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    return value


def _shape_dtype(name: str, array: Any) -> tuple[tuple[int, ...], Any, bool]:
    """Shape, dtype and whether the values are all finite, for numpy arrays and torch tensors."""
    shape = getattr(array, "shape", None)
    dtype = getattr(array, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(
            f"{name} must be a numpy array or torch tensor of shape (..., tokens, features), "
            f"got {type(array).__name__}"
        )
    shape = tuple(int(s) for s in shape)
    if isinstance(array, np.ndarray):
        floating = np.issubdtype(array.dtype, np.floating)
    else:  # torch.Tensor
        floating = bool(getattr(array, "is_floating_point", lambda: False)())
    if not floating:
        raise TypeError(f"{name} must have a real floating dtype (float16/32/64), got {dtype}")
    if isinstance(array, np.ndarray):
        finite = bool(np.isfinite(array).all())
    else:
        import torch

        # a NaN or an infinity makes the sum non-finite, so a finite sum proves every entry finite in
        # one reduction; only a non-finite sum (which may be overflow) needs the elementwise test
        finite = bool(torch.isfinite(array.sum())) or bool(torch.isfinite(array).all())
    return shape, dtype, finite


def check_qkv_shapes(q: Any, k: Any, v: Any) -> tuple[tuple[int, ...], int, int, int, int]:
    """Validate queries, keys and values of one attention call.

    Parameters
    ----------
    q : (..., N, D) array or tensor
    k : (..., M, D) array or tensor
    v : (..., M, Dv) array or tensor

    Returns
    -------
    batch_shape, N, M, D, Dv
        The common leading (batch) shape and the sizes.

    Raises
    ------
    TypeError
        When an input is not a floating array.
    ValueError
        When shapes disagree, a sequence is empty, or a value is NaN or infinite.
    """
    shapes = {}
    for name, array in (("q", q), ("k", k), ("v", v)):
        shape, _, finite = _shape_dtype(name, array)
        if len(shape) < 2:
            raise ValueError(f"{name} must have shape (..., tokens, features), got shape {shape}")
        if shape[-1] == 0:
            raise ValueError(f"{name} has no features: shape {shape}")
        if shape[-2] == 0:
            raise ValueError(f"{name} is an empty sequence (0 tokens): shape {shape}")
        if not finite:
            raise ValueError(f"{name} contains NaN or infinite values")
        shapes[name] = shape
    qs, ks, vs = shapes["q"], shapes["k"], shapes["v"]
    if qs[-1] != ks[-1]:
        raise ValueError(f"q and k must have the same feature dim D: q {qs}, k {ks}")
    if ks[-2] != vs[-2]:
        raise ValueError(f"k and v must have the same number of tokens M: k {ks}, v {vs}")
    if not (qs[:-2] == ks[:-2] == vs[:-2]):
        raise ValueError(f"q, k and v must have the same batch dims: q {qs}, k {ks}, v {vs}")
    return qs[:-2], qs[-2], ks[-2], qs[-1], vs[-1]
