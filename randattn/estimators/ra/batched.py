"""Randomized attention in torch (batched form of ``ra.reference``), chunked over samples."""

from __future__ import annotations

from typing import Any

import torch

from randattn.estimators._prepare import check_draw_array, prepare_batched, to_torch_draws
from randattn.estimators.base import Draws
from randattn.estimators.ra.reference import check_ra_params, noise_std

__all__ = ["estimate"]

#: cap on the elements of the (N, S_chunk, M) logits block of one replicate and batch element; the chunk
#: depends on N and M only, so that a result does not change with how many replicates or heads run together
_MAX_BLOCK = 1 << 21


def _f_mean(omega: torch.Tensor, y: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Sum over samples of f_n(omega) (eq. 6) for omega (R, ..., N, S, D), chunked over S.

    Queries and samples are folded into one matrix dimension so that each product is
    ``(R, ..., N s, D) @ (..., D, M)``: a broadcasting matmul against ``(1, ..., 1, D, M)``
    would materialize the keys (and values) once per query, ``R N D M`` elements.
    """
    reps, num_q, num_s, dim = omega.shape[0], omega.shape[-3], omega.shape[-2], omega.shape[-1]
    batch = omega.shape[1:-3]
    half_sq = 0.5 * (y * y).sum(-1).unsqueeze(-2)  # (..., 1, M)
    chunk = max(1, _MAX_BLOCK // (num_q * y.shape[-2]))
    yt = y.transpose(-1, -2).contiguous()  # (..., D, M); a transposed view broadcast over R takes a BLAS path whose rounding depends on R
    total = None
    for start in range(0, num_s, chunk):
        block = omega[..., start : start + chunk, :]
        s = block.shape[-2]
        flat = block.reshape(reps, *batch, num_q * s, dim)
        logits = flat @ yt - half_sq  # (R, ..., N s, M)
        f = torch.softmax(logits, dim=-1) @ v  # (R, ..., N s, Dv)
        part = f.reshape(reps, *batch, num_q, s, v.shape[-1]).sum(-2)
        total = part if total is None else total + part
    return total


def estimate(
    q: Any,
    k: Any,
    v: Any,
    draws: Draws,
    *,
    scale: float | None = None,
    variant: str = "unbiased",
    noise: str = "paper",
    sample: str = "random",
) -> torch.Tensor:
    """Randomized attention over (R, ..., N, Dv); same signature and layout as ``ra.reference.estimate``."""
    check_ra_params(variant, sample)
    x, y, v, scale, batch = prepare_batched(q, k, v, scale)
    sigma = noise_std(noise, scale)
    num_q, dim = x.shape[-2], x.shape[-1]
    log_pi = torch.log_softmax(x @ y.transpose(-1, -2), dim=-1)
    if sample == "mean":
        mean = x + torch.exp(log_pi) @ y
        omega = mean.unsqueeze(0).expand(draws.replicates, *mean.shape).unsqueeze(-2)
        return _f_mean(omega, y, v)
    draws = to_torch_draws(draws, x)
    eps = check_draw_array(draws, "eps", batch, (num_q, None, dim))
    num_samples = eps.shape[-2]
    if variant == "biased":
        mean = x + torch.exp(log_pi) @ y
        omega = mean.unsqueeze(0).unsqueeze(-2) + sigma * eps
    else:
        u = check_draw_array(draws, "u", batch, (num_q, num_samples))
        cdf = torch.cumsum(torch.exp(log_pi), dim=-1)  # (..., N, M)
        cdf_r = cdf.unsqueeze(0).expand(draws.replicates, *cdf.shape).contiguous()
        # searchsorted(right=False) counts entries strictly below u: #{m : F_nm < u}
        z = torch.searchsorted(cdf_r, u.contiguous(), right=False).clamp_max(y.shape[-2] - 1)
        y_b = y.unsqueeze(0).expand(draws.replicates, *y.shape)
        picked = torch.gather(y_b, -2, z.reshape(*z.shape[:-2], -1, 1).expand(*z.shape[:-2], z.shape[-2] * num_samples, dim))
        omega = x.unsqueeze(0).unsqueeze(-2) + picked.reshape(*z.shape, dim) + sigma * eps
    return _f_mean(omega, y, v) / num_samples
