"""Nyströmformer attention in torch: ``reference.estimate`` batched, on any device and dtype.

The same equations, landmarks and output layout as :mod:`randattn_nystrom.reference`; every
shape is a Python int, so nothing is read back from the device (no ``.item()``, no sync).
"""

from __future__ import annotations

from typing import Any

import torch

from randattn.estimators import Draws
from randattn_nystrom.reference import check_inputs, num_landmarks

__all__ = ["segment_means", "iterative_pinv", "estimate"]


def segment_means(x: torch.Tensor, count: int) -> torch.Tensor:
    """Landmarks ``(..., c, D)`` of ``x : (..., T, D)`` over ``reference.segment_bounds``' segments (eq. 16).

    Each segment's tokens are gathered into a row of ``ceil(T / c)`` slots (the shorter ones
    padded and masked) and summed: ``O(T D)`` memory, and a fixed summation order, unlike a
    scatter-add, whose atomic float adds on a GPU would change the bits from run to run.
    """
    length = x.shape[-2]
    j = torch.arange(count + 1, device=x.device)
    bounds = j * length // count  # b_j = floor(j T / c)
    starts, sizes = bounds[:-1], bounds[1:] - bounds[:-1]
    slots = torch.arange(-(-length // count), device=x.device)
    valid = slots < sizes[:, None]  # (c, width)
    index = torch.where(valid, starts[:, None] + slots, 0)
    gathered = x[..., index, :] * valid[..., None].to(x.dtype)  # (..., c, width, D)
    return gathered.sum(-2) / sizes[:, None].to(x.dtype)


def iterative_pinv(a: torch.Tensor, iterations: int) -> torch.Tensor:
    """Eq. 14 from ``Z_0 = A^T / (||A||_1 ||A||_inf)``, per matrix of ``a : (..., c, c)`` (see ``reference``)."""
    norm = a.abs().sum(-2).amax(-1) * a.abs().sum(-1).amax(-1)
    z = a.transpose(-1, -2) / norm[..., None, None]
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    for _ in range(iterations):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


def estimate(
    q: Any, k: Any, v: Any, draws: Draws, *, scale: float | None = None, pinv: str = "iterative", pinv_iterations: int = 6
) -> torch.Tensor:
    """Nyströmformer attention (eq. 17): ``(R, ..., N, Dv)`` in q's dtype and device. See ``reference.estimate``.

    ``A`` and ``A^+`` are computed in float64 for every input dtype; ``pinv="exact"`` is
    ``torch.linalg.pinv`` (SVD; ``hermitian=False``, ``A`` is not symmetric) with its default
    cutoff, ``c`` float64 eps, the reference's.
    """
    q, k, v = (a if isinstance(a, torch.Tensor) else torch.as_tensor(a) for a in (q, k, v))
    batch, scale = check_inputs(q, k, v, scale, pinv, pinv_iterations)
    c = min(num_landmarks(draws, batch), q.shape[-2], k.shape[-2])
    q_lm, k_lm = segment_means(q, c), segment_means(k, c)
    f = torch.softmax(scale * q @ k_lm.transpose(-1, -2), dim=-1)  # (..., N, c); softmax subtracts the max
    b = torch.softmax(scale * q_lm @ k.transpose(-1, -2), dim=-1)  # (..., c, M)
    # A^+ multiplies rounding errors by cond(A), 1e11 on ViT-like activations: A, A^+ and the products
    # through it in float64 whatever the input dtype (c x c and N x c: cheap), as LARA's signed weights
    q_lm, k_lm = q_lm.double(), k_lm.double()
    a = torch.softmax(scale * q_lm @ k_lm.transpose(-1, -2), dim=-1)  # (..., c, c)
    z = torch.linalg.pinv(a, hermitian=False) if pinv == "exact" else iterative_pinv(a, pinv_iterations)
    out = (f.double() @ (z @ (b @ v).double())).to(q.dtype)
    return out.unsqueeze(0).expand(draws.replicates, *out.shape).clone()
