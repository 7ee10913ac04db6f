"""Randomized attention in numpy float64 (reference form)."""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy.special import log_softmax, softmax

from randattn._validation import check_choice
from randattn.estimators._prepare import check_draw_array, prepare_reference
from randattn.estimators.base import Draws

__all__ = ["estimate", "noise_std", "check_ra_params"]


def noise_std(noise: str, scale: float) -> float:
    """Std of omega's noise in the paper's space: 1 (``paper``) or ``sqrt(scale)`` (``reference-code``).

    The official code adds N(0, I) to the unscaled ``q + k``; mapped to ``x = sqrt(scale) q``
    that is N(0, scale I): N(0, D^-1/2 I) at the ViT temperature (ARCHITECTURE sec. 10).
    """
    check_choice("noise", noise, ("paper", "reference-code"))
    return 1.0 if noise == "paper" else float(np.sqrt(scale))


def check_ra_params(variant: str, sample: str) -> None:
    check_choice("variant", variant, ("unbiased", "biased"))
    check_choice("sample", sample, ("random", "mean"))
    if variant == "unbiased" and sample == "mean":
        raise ValueError(
            "sample='mean' is only defined for variant='biased' (the unbiased sampler's mean "
            "would replace the random component index too, LARA app. G.2)"
        )


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
) -> np.ndarray:
    r"""Randomized attention (LARA sec. 3.2, app. G.2, Algorithm 1).

    .. math::
        \mathrm{RA}(q_n) = \frac{1}{S} \sum_s f_n(\omega_{ns}), \qquad
        f_n(\omega) = \sum_m \mathrm{softmax}_m\big(\omega^\top y_m - \|y_m\|^2/2\big) v_m
        \quad \text{(eq. 6; } \xi(x_n, \omega) \text{ cancels)},

    with ``omega_ns = x_n + y_{z_ns} + sigma eps_ns``, ``z_ns ~ Categorical(pi_n)``,
    ``pi_nm = softmax_m(x_n·y_m)`` (unbiased, eq. 29-30), or
    ``omega_ns = x_n + sum_m pi_nm y_m + sigma eps_ns`` (biased, eq. 31).

    Parameters
    ----------
    q : (..., N, D)
    k : (..., M, D)
    v : (..., M, Dv)
    draws : Draws
        ``u : (R, ..., N, S)`` (unbiased) and ``eps : (R, ..., N, S, D)``; empty for ``sample="mean"``.
    scale : float, optional
    variant : {"unbiased", "biased"}
    noise : {"paper", "reference-code"}
    sample : {"random", "mean"}

    Returns
    -------
    (R, ..., N, Dv)

    Notes
    -----
    The component index is ``z_ns = #{m : F_nm < u_ns}`` with ``F_n`` the CDF of ``pi_n``
    (inverse-CDF sampling), so that ``u ~ U(0, 1)`` gives ``z ~ Categorical(pi_n)``.
    Quadratic in N, M by construction (LARA sec. 3.2).
    """
    check_ra_params(variant, sample)
    x, y, v, scale, batch = prepare_reference(q, k, v, scale)
    sigma = noise_std(noise, scale)
    num_q, dim = x.shape[-2], x.shape[-1]
    log_pi = log_softmax(x @ np.swapaxes(y, -1, -2), axis=-1)  # (..., N, M)
    if sample == "mean":
        mean = x + np.exp(log_pi) @ y  # (..., N, D)
        omega = np.broadcast_to(mean, (draws.replicates, *mean.shape))[..., None, :]  # (R, ..., N, 1, D)
    elif variant == "biased":
        eps = check_draw_array(draws, "eps", batch, (num_q, None, dim))
        mean = x + np.exp(log_pi) @ y
        omega = mean[None, ..., None, :] + sigma * eps
    else:
        u = check_draw_array(draws, "u", batch, (num_q, None))
        eps = check_draw_array(draws, "eps", batch, (num_q, u.shape[-1], dim))
        cdf = np.cumsum(np.exp(log_pi), axis=-1)  # (..., N, M)
        z = (cdf[None, ..., None, :] < u[..., None]).sum(-1)  # (R, ..., N, S)
        z = np.minimum(z, y.shape[-2] - 1)  # u above a rounded-down total mass
        y_b = np.broadcast_to(y, (draws.replicates, *y.shape))
        picked = np.take_along_axis(y_b, z.reshape(*z.shape[:-2], -1)[..., None], axis=-2)
        picked = picked.reshape(*z.shape, dim)  # (R, ..., N, S, D)
        omega = x[None, ..., None, :] + picked + sigma * eps
    # f_n(omega): softmax over keys of log xi(y_m, omega) = omega·y_m - |y_m|^2/2
    half_sq = 0.5 * (y * y).sum(-1)  # (..., M)
    logits = np.einsum("r...nsd,...md->r...nsm", omega, y) - half_sq[None, ..., None, None, :]
    f = softmax(logits, axis=-1) @ v[None, ..., None, :, :]  # (R, ..., N, S, Dv)
    return f.mean(-2)
