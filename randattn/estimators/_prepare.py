"""Input preparation shared by the reference and batched estimators.

Validates q/k/v once (``_validation.check_qkv_shapes``), resolves the temperature and
moves to the paper's variables ``x = q sqrt(scale)``, ``y = k sqrt(scale)`` so that
``exp(x·y) = exp(scale q·k)`` (ARCHITECTURE sec. 3).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from randattn._validation import check_qkv_shapes, check_scale
from randattn.estimators.base import Draws

__all__ = ["prepare_reference", "prepare_batched", "unscaled_batched", "check_draw_array", "to_torch_draws"]


def prepare_reference(q: Any, k: Any, v: Any, scale: float | None):
    """float64 numpy ``(x, y, v, scale, batch_shape)`` from validated inputs."""
    batch, _, _, dim, _ = check_qkv_shapes(q, k, v)
    scale = check_scale(scale, dim)
    root = np.sqrt(scale)
    as64 = lambda a: np.asarray(a.detach().cpu() if hasattr(a, "detach") else a, dtype=np.float64)  # noqa: E731
    return as64(q) * root, as64(k) * root, as64(v), scale, batch


def prepare_batched(q: Any, k: Any, v: Any, scale: float | None):
    """torch ``(x, y, v, scale, batch_shape)``: numpy inputs become float64 tensors; tensors keep dtype/device."""
    q, k, v, scale, batch = unscaled_batched(q, k, v, scale)
    root = scale**0.5
    return q * root, k * root, v, scale, batch


def unscaled_batched(q: Any, k: Any, v: Any, scale: float | None):
    """torch ``(q, k, v, scale, batch_shape)`` validated as :func:`prepare_batched` does, not multiplied by ``sqrt(scale)``.

    For forms that take the temperature elsewhere (in feature weights), sparing scaled copies of the inputs.
    """
    import torch

    batch, _, _, dim, _ = check_qkv_shapes(q, k, v)
    scale = check_scale(scale, dim)
    as_tensor = lambda a: a if isinstance(a, torch.Tensor) else torch.as_tensor(np.asarray(a))  # noqa: E731
    q, k, v = as_tensor(q), as_tensor(k), as_tensor(v)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in (torch.float32, torch.float64):
        # float16 overflows any logit above 65,504 (norms of a few hundred) into a silent NaN, and neither half
        # format holds the draws (a budget of 2,049 keys is 2,048 in float16): as randattn.estimate's dtype says
        raise TypeError(f"q, k and v are {q.dtype}: the batched forms compute in torch.float32 or torch.float64 "
                        "(half precision overflows logits above 65,504 and cannot hold the draws); convert them, "
                        "e.g. q.float()")
    return q, k, v, scale, batch


def to_torch_draws(draws: Draws, like: Any) -> Draws:
    """``draws`` as tensors with the dtype and device of ``like`` (a no-op when they already are)."""
    import torch

    first = next(iter(draws.arrays.values()), None)
    if isinstance(first, torch.Tensor) and first.dtype == like.dtype and first.device == like.device:
        return draws
    return Draws(
        {k: torch.as_tensor(a).to(device=like.device, dtype=like.dtype) for k, a in draws.arrays.items()},
        draws.replicates,
    )


def check_draw_array(draws: Draws, key: str, prefix: Sequence[int], trailing: Sequence[int | None]) -> Any:
    """Return ``draws[key]`` after checking it is ``(R, *batch, *trailing)`` (None = any size)."""
    if not isinstance(draws, Draws):
        raise TypeError(f"draws must be a Draws object made by the estimator's draw(), got {type(draws).__name__}")
    array = draws[key]
    shape = tuple(array.shape)
    expected_prefix = (draws.replicates, *prefix)
    ok = len(shape) == len(expected_prefix) + len(trailing) and shape[: len(expected_prefix)] == expected_prefix
    if ok:
        ok = all(t is None or t == s for t, s in zip(trailing, shape[len(expected_prefix):]))
    if not ok:
        want = ", ".join(["R", *map(str, prefix), *("*" if t is None else str(t) for t in trailing)])
        raise ValueError(
            f"draws[{key!r}] has shape {shape}, expected ({want}) with R={draws.replicates}: "
            "were the draws made for inputs of another shape?"
        )
    return array
