"""Randomized attention in numpy float64 (reference form), bidirectional or causal."""

from __future__ import annotations

from typing import Any

from dataclasses import dataclass

import numpy as np
from scipy.special import log_softmax, softmax

from randattn._validation import check_choice
from randattn.estimators._prepare import check_draw_array, prepare_reference
from randattn.estimators.base import Draws, EstimatorOptions, keyword_entry, option
from randattn.estimators.masks import DECLARABLE_MASKS, Mask, check_mask_argument, last_visible_key

__all__ = ["estimate", "noise_std", "check_ra_params", "visible_keys", "RaOptions", "NOISES", "VARIANTS", "SAMPLES"]

#: the two samplers of LARA sec. 3.2: omega ~ p_n (eq. 29-30), or the mean-field Gaussian (eq. 31)
VARIANTS = ("unbiased", "biased")
#: omega's noise: the paper's N(0, I), or the official code's (:func:`noise_std`)
NOISES = ("paper", "reference-code")
#: random samples, or the biased variant's expected sample (LARA G.2 eval mode)
SAMPLES = ("random", "mean")


def noise_std(noise: str, scale: float) -> float:
    """Std of omega's noise in the paper's space: 1 (``paper``) or ``sqrt(scale)`` (``reference-code``).

    The official code adds N(0, I) to the unscaled ``q + k``; mapped to ``x = sqrt(scale) q``
    that is N(0, scale I): N(0, D^-1/2 I) at the ViT temperature (ARCHITECTURE sec. 10).
    """
    check_choice("noise", noise, NOISES)
    return 1.0 if noise == "paper" else float(np.sqrt(scale))


def check_ra_params(variant: str, sample: str) -> None:
    check_choice("variant", variant, VARIANTS)
    check_choice("sample", sample, SAMPLES)
    if variant == "unbiased" and sample == "mean":
        raise ValueError(
            "sample='mean' is only defined for variant='biased' (the unbiased sampler's mean "
            "would replace the random component index too, LARA app. G.2)"
        )


@dataclass(frozen=True, kw_only=True)
class RaOptions(EstimatorOptions):
    """RA's keyword options, declared once: the spec's ``params`` and every entry point's keywords.

    Construction runs :func:`check_ra_params` and checks ``mask`` (None, ``"causal"`` or ``"sliding:W"``), so a
    bad option raises before any input is touched.
    """

    variant: str = option(
        "unbiased", "unbiased: omega ~ p_n (eq. 29-30); biased: omega ~ N(K pi_n + q_n, I) (eq. 31)", choices=VARIANTS
    )
    noise: str = option(
        "paper",
        "paper: eps ~ N(0, I); reference-code: the official code's N(0, I) in unscaled space = N(0, scale I)",
        choices=NOISES,
    )
    sample: str = option(
        "random", "random, or mean: the biased variant's expected sample (LARA G.2 eval mode)", choices=SAMPLES
    )
    mask: str | None = None

    def check(self) -> None:
        check_ra_params(self.variant, self.sample)
        check_mask_argument(self.mask, DECLARABLE_MASKS)


def visible_keys(mask: str | None, num_queries: int, num_keys: int) -> np.ndarray | None:
    """``(N, M)`` boolean visibility of ``mask`` (:meth:`~randattn.estimators.masks.Mask.visible`), None for none.

    Raises ValueError for a mask other than None, ``"causal"`` and ``"sliding:W"``, and for a mask with M < N.
    """
    return Mask.parse(check_mask_argument(mask, DECLARABLE_MASKS)).visible(num_queries, num_keys)


def _first_visible_key(mask: str | None, num_queries: int, num_keys: int) -> np.ndarray | int:
    """``(N, 1)`` the first key each query sees under a sliding window, ``n + M - N - W + 1`` (at least 0); 0 for
    the other masks, under which key 0 is visible to every query."""
    window = Mask.parse(mask).window
    if window is None:
        return 0
    return np.maximum(last_visible_key(num_queries, num_keys) - window + 1, 0)[:, None]


@keyword_entry(RaOptions)
def estimate(q: Any, k: Any, v: Any, draws: Draws, options: RaOptions) -> np.ndarray:
    r"""Randomized attention (LARA sec. 3.2, app. G.2, Algorithm 1), bidirectional or causal.

    .. math::
        \mathrm{RA}(q_n) = \frac{1}{S} \sum_s f_n(\omega_{ns}), \qquad
        f_n(\omega) = \sum_m \mathrm{softmax}_m\big(\omega^\top y_m - \|y_m\|^2/2\big) v_m
        \quad \text{(eq. 6; } \xi(x_n, \omega) \text{ cancels)},

    with ``omega_ns = x_n + y_{z_ns} + sigma eps_ns``, ``z_ns ~ Categorical(pi_n)``,
    ``pi_nm = softmax_m(x_n·y_m)`` (unbiased, eq. 29-30), or
    ``omega_ns = x_n + sum_m pi_nm y_m + sigma eps_ns`` (biased, eq. 31).

    Under ``mask="causal"`` every sum over keys runs over the keys query n sees, ``V_n = {m : m <=
    n + M - N}`` (:mod:`randattn.estimators.masks`): the mixture weights
    ``pi_nm = exp(x_n·y_m) / sum_{m' in V_n} exp(x_n·y_m')`` for m in V_n and 0 otherwise (eq. 29),
    so the component ``z_ns`` is a visible key (eq. 30) and the biased mean is
    ``x_n + sum_{m in V_n} pi_nm y_m`` (eq. 31); and eq. 6 becomes
    ``f_n(omega) = sum_{m in V_n} softmax_{m in V_n}(omega·y_m - |y_m|^2/2) v_m``. This is RA for
    the causal softmax target ``sum_{m in V_n} softmax_{m in V_n}(x_n·y_m) v_m`` (Prop. 3.2 holds
    query by query with M replaced by V_n), so the unbiased variant stays unbiased for it. Under
    ``mask="sliding:W"`` the same holds with ``V_n`` the last W of those keys, ``n + M - N - W < m <= n + M - N``.

    Parameters
    ----------
    q, k, v : array_like
        Queries (..., N, D), keys (..., M, D), values (..., M, Dv).
    draws : Draws
        ``u : (R, ..., N, S)`` (unbiased) and ``eps : (R, ..., N, S, D)``; empty for ``sample="mean"``.
    scale : float, optional
    variant : {"unbiased", "biased"}
    noise : {"paper", "reference-code"}
    sample : {"random", "mean"}
    mask : {None, "causal", "sliding:W"}
        None: every query sees every key. ``"causal"``: key m is visible to query n iff
        ``m <= n + M - N``; ``"sliding:W"``: the last W of those; a mask needs M >= N. The draws are the same
        either way.

    Returns
    -------
    (R, ..., N, Dv)

    Notes
    -----
    The component index is ``z_ns = #{m : F_nm < u_ns}`` with ``F_n`` the CDF of ``pi_n``
    (inverse-CDF sampling), so that ``u ~ U(0, 1)`` gives ``z ~ Categorical(pi_n)``.
    Quadratic in N, M by construction (LARA sec. 3.2), causal or not: the causal form is the
    bidirectional one with the hidden logits set to -inf (weights exactly 0), not a prefix scan.
    Under causal, ``F_nm`` is flat after the last visible key, so the count can pass it only
    when ``u`` lies above a rounded-down total mass; the index is then clamped to the last
    visible key (not to M - 1).
    """
    x, y, v, scale, batch = prepare_reference(q, k, v, options.scale)
    sigma = noise_std(options.noise, scale)
    num_q, dim = x.shape[-2], x.shape[-1]
    visible = visible_keys(options.mask, num_q, y.shape[-2])  # (N, M) or None
    logits_pi = x @ np.swapaxes(y, -1, -2)  # (..., N, M)
    if visible is not None:
        # -inf, not a large negative number: exp gives exact zeros, so hidden keys' values never enter
        logits_pi = np.where(visible, logits_pi, -np.inf)
    log_pi = log_softmax(logits_pi, axis=-1)  # (..., N, M); eq. 29's pi_n, over V_n under causal
    if options.sample == "mean":
        mean = x + np.exp(log_pi) @ y  # (..., N, D)
        omega = np.broadcast_to(mean, (draws.replicates, *mean.shape))[..., None, :]  # (R, ..., N, 1, D)
    elif options.variant == "biased":
        eps = check_draw_array(draws, "eps", batch, (num_q, None, dim))
        mean = x + np.exp(log_pi) @ y
        omega = mean[None, ..., None, :] + sigma * eps
    else:
        u = check_draw_array(draws, "u", batch, (num_q, None))
        eps = check_draw_array(draws, "eps", batch, (num_q, u.shape[-1], dim))
        cdf = np.cumsum(np.exp(log_pi), axis=-1)  # (..., N, M)
        z = (cdf[None, ..., None, :] < u[..., None]).sum(-1)  # (R, ..., N, S)
        # u above a rounded-down total mass: clamp to the last key the query sees; under a window, u = 0 (drawn
        # with probability 2^-53) would count no key and pick key 0: clamp to the window's first key
        top = y.shape[-2] - 1 if visible is None else last_visible_key(num_q, y.shape[-2])[:, None]
        z = np.clip(z, _first_visible_key(options.mask, num_q, y.shape[-2]), top)
        y_b = np.broadcast_to(y, (draws.replicates, *y.shape))
        picked = np.take_along_axis(y_b, z.reshape(*z.shape[:-2], -1)[..., None], axis=-2)
        picked = picked.reshape(*z.shape, dim)  # (R, ..., N, S, D)
        omega = x[None, ..., None, :] + picked + sigma * eps
    # f_n(omega): softmax over keys of log xi(y_m, omega) = omega·y_m - |y_m|^2/2
    half_sq = 0.5 * (y * y).sum(-1)  # (..., M)
    logits = np.einsum("r...nsd,...md->r...nsm", omega, y) - half_sq[None, ..., None, None, :]
    if visible is not None:
        logits = np.where(visible[:, None, :], logits, -np.inf)  # (N, 1, M) over (R, ..., N, S, M)
    f = softmax(logits, axis=-1) @ v[None, ..., None, :, :]  # (R, ..., N, S, Dv)
    return f.mean(-2)
