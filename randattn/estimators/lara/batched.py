"""LARA in torch (batched form of ``lara.reference``): same signatures, layouts and draws.

Vectorized over replicates, batch dims, queries and proposals; the weighting functions are
formed only at each proposal's own sample (``(R, ..., N, C)``) instead of at every sample.

Each public entry point is written on validated
:class:`~randattn.estimators.lara.reference.LaraOptions`; :func:`~randattn.estimators.base.keyword_entry`
gives it the keyword signature the engine and the registry call (``f(q, k, v, draws, *, scale=..., **params)``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from randattn.estimators._prepare import check_draw_array, prepare_batched, to_torch_draws
from randattn.estimators.base import Draws, keyword_entry
from randattn.estimators.features.batched import positive_log_features
from randattn.estimators.lara.reference import (
    LaraOptions,
    LaraTerms,
    _warn_non_positive,
    effective_proposals,
    landmarks,
)
from randattn.estimators.ra.reference import noise_std
from randattn.estimators.segments import segment_means_torch

__all__ = [
    "lara_terms",
    "estimate",
    "probabilities",
    "estimate_with_probabilities",
    "estimate_with_float32_probabilities",
    "estimate_with_probability_factors",
    "float32_quotient_bound",
    "log_target_density",
    "log_unnormalized_target",
    "f_values",
    "snis_estimate_eq10",
    "mis_estimate_eq8",
]

_LOG_2PI = math.log(2.0 * math.pi)

#: unit roundoff of float32, and half its smallest subnormal (the absolute error of a rounding that underflows)
_U32 = 2.0**-24
_ETA32 = 2.0**-150


def _log_gaussian(sq_dist: torch.Tensor, dim: int) -> torch.Tensor:
    return -0.5 * sq_dist - 0.5 * dim * _LOG_2PI


def _component_log_weights(x_lm: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``log softmax_m(x~_c · y_m)`` : (..., C, M)."""
    return torch.log_softmax(x_lm @ y.transpose(-1, -2), dim=-1)


def _proposal_means(x_lm: torch.Tensor, y_lm: torch.Tensor | None, y: torch.Tensor, proposal: str) -> torch.Tensor:
    """``mu_c`` (..., C, D); see ``reference.proposal_means``."""
    if proposal == "standard":
        return torch.zeros_like(x_lm)
    if proposal == "eq34":
        return x_lm + y_lm
    if proposal == "eq35":
        return x_lm + torch.softmax(y_lm @ y_lm.transpose(-1, -2), dim=-1) @ y_lm
    return x_lm + torch.exp(_component_log_weights(x_lm, y)) @ y


def _pairwise_sq_dist(centre: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
    """``|omega_j - centre_i|^2`` : (R, ..., I, J) for centre (..., I, D), omega (R, ..., J, D).

    In float32, ``torch.cdist`` without the matrix-product expansion: differences are taken
    directly (no cancellation of ``|omega|^2 - 2 omega.mu + |mu|^2`` at norms ~ 50, which would
    cost ~0.3 absolute in float32) and no (I, J, D) tensor. In float64 that cancellation costs
    ~1e-12 and the expansion's matrix product is ~10x faster (a third of signed LARA's time at
    197 tokens, S = 128), so float64 takes it.
    """
    centre = centre.unsqueeze(0).expand(omega.shape[0], *centre.shape)
    mode = "use_mm_for_euclid_dist" if omega.dtype == torch.float64 else "donot_use_mm_for_euclid_dist"
    return torch.cdist(centre, omega, compute_mode=mode).square()


def _sq_dist_to_mixture_means(omega: torch.Tensor, centre: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``|omega_j - centre_i - y_m|^2`` : (R, ..., I, J, M) for omega (R, ..., J, D), centre (..., I, D)."""
    omega_y = omega @ y.transpose(-1, -2).unsqueeze(0)  # (R, ..., J, M)
    centre_y = centre @ y.transpose(-1, -2)  # (..., I, M)
    y_sq = (y * y).sum(-1)
    return (_pairwise_sq_dist(centre, omega).unsqueeze(-1) - 2.0 * omega_y.unsqueeze(-3)
            + (2.0 * centre_y + y_sq.unsqueeze(-2)).unsqueeze(0).unsqueeze(-2))


def _log_proposal_densities(
    omega: torch.Tensor, x_lm: torch.Tensor, y: torch.Tensor, mu: torch.Tensor, proposal: str
) -> torch.Tensor:
    """``log q_c'(omega_j)`` (R, ..., C', J); see ``reference.log_proposal_densities``."""
    dim = omega.shape[-1]
    if proposal != "eq32":
        return _log_gaussian(_pairwise_sq_dist(mu, omega), dim)
    log_pi = _component_log_weights(x_lm, y).unsqueeze(0).unsqueeze(-2)  # (1, ..., C', 1, M)
    return torch.logsumexp(log_pi + _log_gaussian(_sq_dist_to_mixture_means(omega, x_lm, y), dim), dim=-1)


def _log_alpha_at_samples(
    log_q: torch.Tensor, scores: torch.Tensor, weighting: str, beta: float, alpha_clamp: float | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log|alpha_nc(omega_c)|`` and sign (R, ..., N, C), only at each proposal's own sample."""
    num_c = log_q.shape[-1]
    num_q = scores.shape[-2]
    diag = torch.diagonal(log_q, dim1=-2, dim2=-1)  # (R, ..., C)
    if weighting in ("balance", "constant"):
        if weighting == "balance":
            log_b = diag - torch.logsumexp(log_q, dim=-2)
        else:
            log_b = torch.full_like(diag, -math.log(num_c))
        log_alpha = log_b.unsqueeze(-2).expand(*log_b.shape[:-1], num_q, num_c)
        if alpha_clamp is not None:
            log_alpha = torch.clamp(log_alpha, min=math.log(alpha_clamp))
        return log_alpha.contiguous(), None
    b = torch.softmax(log_q, dim=-2)  # (R, ..., C', J): b_c'(omega_j)
    b_own = torch.diagonal(b, dim1=-2, dim2=-1).unsqueeze(-2)  # (R, ..., 1, C)
    if weighting == "decoupled":
        alpha = b_own + beta * (scores - scores.mean(-1, keepdim=True)).unsqueeze(0)
    else:  # coupled, eq. 37 at omega_c
        average = scores.unsqueeze(0) @ b  # (R, ..., N, C): sum_c' r'_nc' b_c'(omega_c)
        alpha = b_own + torch.exp(diag).unsqueeze(-2) * (scores.unsqueeze(0) - average)
    if alpha_clamp is not None:
        return torch.log(torch.clamp(alpha, min=alpha_clamp)), None
    return torch.log(alpha.abs()), torch.sign(alpha)


def _proposals(q: Any, k: Any, v: Any, draws: Draws, options: LaraOptions) -> tuple[torch.Tensor, ...]:
    """``(x, y, v, x_lm, omega, log_q)`` of Algorithm 3, up to the proposal densities."""
    proposal = options.proposal
    x, y, v, scale, batch = prepare_batched(q, k, v, options.scale)
    sigma = noise_std(options.noise, scale)
    num_q, num_k, dim = x.shape[-2], y.shape[-2], x.shape[-1]
    draws = to_torch_draws(draws, x)
    if options.sample == "mean":
        drawn = check_draw_array(draws, "proposal_slots", batch, (None, 0)).shape[-2]
    else:
        drawn = check_draw_array(draws, "eps", batch, (None, dim)).shape[-2]
    token_layout = options.token_layout
    num_c = effective_proposals(num_q, num_k, drawn, proposal, token_layout)
    x_lm, y_lm = landmarks(x, y, num_c, proposal, token_layout, means=segment_means_torch)
    mu = _proposal_means(x_lm, y_lm, y, proposal)
    if options.sample == "mean":
        omega = mu.unsqueeze(0).expand(draws.replicates, *mu.shape).contiguous()
    else:
        eps = draws["eps"][..., :num_c, :]
        if proposal == "eq32":
            u = check_draw_array(draws, "u", batch, (drawn,))[..., :num_c]
            cdf = torch.cumsum(torch.exp(_component_log_weights(x_lm, y)), dim=-1)  # (..., C, M)
            cdf_r = cdf.unsqueeze(0).expand(draws.replicates, *cdf.shape).contiguous()
            # searchsorted(right=False) counts entries strictly below u: #{m : F_cm < u_c}
            z = torch.searchsorted(cdf_r, u.unsqueeze(-1).contiguous(), right=False).clamp_max(num_k - 1)
            y_b = y.unsqueeze(0).expand(draws.replicates, *y.shape)
            picked = torch.gather(y_b, -2, z.expand(*z.shape[:-1], dim))  # (R, ..., C, D)
            omega = x_lm.unsqueeze(0) + picked + sigma * eps
        else:
            omega = mu.unsqueeze(0) + sigma * eps
    log_q = _log_proposal_densities(omega, x_lm, y, mu, proposal)
    return x, y, v, x_lm, omega, log_q


@keyword_entry(LaraOptions)
def lara_terms(q: Any, k: Any, v: Any, draws: Draws, options: LaraOptions) -> LaraTerms:
    """Torch form of ``reference.lara_terms`` (tensors in a :class:`~randattn.estimators.lara.reference.LaraTerms`)."""
    x, y, v, x_lm, omega, log_q = _proposals(q, k, v, draws, options)
    scores = torch.softmax(x @ x_lm.transpose(-1, -2), dim=-2)  # r'_nc, softmax over queries n
    log_abs_alpha, alpha_sign = _log_alpha_at_samples(log_q, scores, options.weighting, options.beta,
                                                      options.alpha_clamp)
    return LaraTerms(x, y, v, omega, log_q, log_abs_alpha, alpha_sign, x_lm)


def _query_weights_t(
    x: torch.Tensor, x_lm: torch.Tensor, log_q: torch.Tensor, weighting: str, beta: float, alpha_clamp: float | None
) -> torch.Tensor:
    """``alpha_nc(omega_c)`` transposed, ``(R, ..., C, N)``, for the query-dependent weightings (eq. 37, 38).

    Same formulas as :func:`_log_alpha_at_samples`, kept linear (not in log space): the
    estimate multiplies them onto exponentials already shifted to at most 1 (and redoes in log
    space the queries where that underflows, :func:`_rescue_underflowed_queries`).
    """
    # r'_nc, a softmax over queries n (eq. 37), in place: fresh (C, N) buffers cost page faults
    scores_t = (x_lm @ x.transpose(-1, -2)).unsqueeze(0)  # (1, ..., C, N)
    scores_t.sub_(scores_t.amax(-1, keepdim=True)).exp_()
    scores_t.div_(scores_t.sum(-1, keepdim=True))
    b = torch.softmax(log_q, dim=-2)  # (R, ..., C', J): b_c'(omega_j)
    b_own = torch.diagonal(b, dim1=-2, dim2=-1).unsqueeze(-1)  # (R, ..., C, 1)
    if weighting == "decoupled":
        alpha = scores_t.sub_(scores_t.mean(-2, keepdim=True)).mul_(beta)
    else:  # coupled, eq. 37 at omega_c: sum_c' r'_nc' b_c'(omega_c)
        average = b.transpose(-1, -2) @ scores_t  # (R, ..., J, N)
        q_own = torch.exp(torch.diagonal(log_q, dim1=-2, dim2=-1)).unsqueeze(-1)
        alpha = (scores_t - average).mul_(q_own)
    alpha = alpha.add_(b_own) if alpha.shape[0] == b_own.shape[0] else alpha + b_own
    if alpha_clamp is not None:
        alpha = alpha.clamp_(min=alpha_clamp)
    return alpha


@keyword_entry(LaraOptions)
def estimate(q: Any, k: Any, v: Any, draws: Draws, options: LaraOptions) -> torch.Tensor:
    r"""LARA over (R, ..., N, Dv); same signature, draws and layout as ``lara.reference.estimate``.

    The eq. 28 form, fused so that each ``(C, N)`` or ``(C, M)`` array is passed over a few
    times only (the reference goes through the generic log-space SNIS skeleton):

    - keys: :math:`E_{cm} = \exp(\omega_c^\top y_m - \|y_m\|^2/2 - s_c)` with
      :math:`s_c = \max_m(\cdot)`, and one product :math:`E\,[v, 1]` gives
      :math:`\sum_m \xi(y_m, \omega_c) v_m` and :math:`\sum_m \xi(y_m, \omega_c)` (times :math:`e^{-s_c}`);
    - queries: :math:`P_{cn} = \omega_c^\top x_n + s_c + \log\mathcal N(\omega_c; 0, I) - \log q_c(\omega_c)`
      (plus :math:`\log\alpha_c` when the weights do not depend on n), shifted by its maximum
      over c; the factor :math:`e^{-\|x_n\|^2/2}` is common to numerator and denominator and
      dropped; query-dependent weights (eq. 37, 38) multiply :math:`e^{P}` with their sign (a query
      whose products underflow, a weight of zero where :math:`P` is largest, is redone with the
      shift :math:`\max_c(P_{cn} + \log|\alpha_{nc}|)` as the reference takes it);
    - one product :math:`W^\top [E v, E 1]` and a division.

    Precision: signed weights (``decoupled`` or ``coupled`` without ``alpha_clamp``) make the
    normalizer a cancelling sum whose float32 rounding error (exponents of order
    :math:`10^3` at ViT key norms, each rounded to ~1e-4 relative) is amplified by
    :math:`\sum_c |w_{nc}| / |\sum_c w_{nc}|`: 2e-2 .. 1e-1 absolute on DINOv2 layer 3. So inputs
    of lower precision are computed in float64 there and the output is returned in their dtype;
    positive weightings stay in the input dtype (their sums do not cancel).
    """
    return _output(*_weights_and_keys(q, k, v, draws, options))


@keyword_entry(LaraOptions)
def probabilities(q: Any, k: Any, draws: Draws, options: LaraOptions) -> torch.Tensor:
    r"""The attention probabilities LARA implies, ``(R, ..., N, M)``: :func:`estimate` with ``v = I_M``.

    Without forming the identity: :math:`\hat P = W^\top E / (W^\top E\,1)` with the query
    weights :math:`W` and key exponentials :math:`E` of :func:`estimate`, one ``(N, C) x (C, M)``
    product (``v = I_M`` would add a ``(C, M) x (M, M)`` one).
    """
    weights_t, key_exp, _, signed, in_dtype = _weights_and_keys(q, k, k, draws, options)
    return _implied_probabilities(weights_t, key_exp, signed, in_dtype)


@keyword_entry(LaraOptions)
def estimate_with_probabilities(q: Any, k: Any, v: Any, draws: Draws,
                                options: LaraOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """``(estimate(q, k, v, ...), probabilities(q, k, ...))``, the same bits: the weights and keys computed once."""
    weights_t, key_exp, v, signed, in_dtype = _weights_and_keys(q, k, v, draws, options)
    out = _output(weights_t, key_exp, v, signed, in_dtype)
    return out, _implied_probabilities(weights_t, key_exp, signed, in_dtype)


@keyword_entry(LaraOptions)
def estimate_with_float32_probabilities(q: Any, k: Any, v: Any, draws: Draws,
                                        options: LaraOptions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""``estimate(q, k, v, ...)``, and the implied probabilities from a float32 product with a bound on its rounding.

    The output is the same bits as :func:`estimate`. The probabilities
    :math:`\hat P = W^\top E / (W^\top E\,1)` are formed from the same weights :math:`W` and key
    exponentials :math:`E` (their exponents computed in float64, so the ~1e-4 relative rounding
    of float32 exponents at ViT norms, which the signed weights' cancellation amplifies, never
    arises); only the ``(N, C) x (C, M)`` product, the costliest step, is taken in float32 on
    :math:`W, E` rounded to float32, and divided by the float64 normalizer.

    Returns
    -------
    out : (R, ..., N, Dv)
        As :func:`estimate`.
    probs : (R, ..., N, M) float32
    bound : (R, ..., N) float64
        :math:`\|\mathrm{probs}_n - \hat P_n\|_2 \le \mathrm{bound}_n`, where :math:`\hat P` is the
        exact quotient of the computed float64 :math:`W` and :math:`E` (see
        :func:`float32_quotient_bound`); ``inf`` where float32 may overflow.
    """
    weights_t, key_exp, v, signed, in_dtype = _weights_and_keys(q, k, v, draws, options)
    out = _output(weights_t, key_exp, v, signed, in_dtype)
    den = _normalizer(weights_t, key_exp, signed)
    weights_t, den = _scaled_to_float32_range(weights_t, den)
    weights32 = weights_t.to(torch.float32)
    inverse32 = den.reciprocal().to(torch.float32)
    probs = (weights32.transpose(-1, -2) @ key_exp.to(torch.float32)).mul_(inverse32)
    bound = float32_quotient_bound(weights_t, key_exp, den[..., 0])
    # where float32 overflows (|W| or 1 / d beyond its range, or a row's entries up to bound_n) the bound says inf
    overflow = ~(torch.isfinite(inverse32[..., 0]) & torch.isfinite(weights32.abs().amax(-2)) & (bound < 2.0**100))
    return out, probs, bound.masked_fill_(overflow, math.inf)


@keyword_entry(LaraOptions)
def estimate_with_probability_factors(q: Any, k: Any, v: Any, draws: Draws,
                                      options: LaraOptions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""``(estimate(q, k, v, ...), L, E)`` with :math:`L = W^\top / d`, so ``probabilities(q, k, ...) = L @ E``.

    The implied probabilities :math:`\hat P = W^\top E / (W^\top E\,1)` have rank C (the proposals'
    samples): ``L (R, ..., N, C)`` holds the query weights divided by their normalizer :math:`d_n`
    (signed for the decoupled and coupled weightings) and ``E (R, ..., C, M)`` the key exponentials,
    shifted to at most 1. The estimate is the same bits as :func:`estimate`, and the warnings those of
    :func:`estimate_with_probabilities`; the factors are in the working precision (float64 for signed
    weights, see :func:`estimate`).
    """
    weights_t, key_exp, v, signed, in_dtype = _weights_and_keys(q, k, v, draws, options)
    out = _output(weights_t, key_exp, v, signed, in_dtype)
    den = _normalizer(weights_t, key_exp, signed)
    return out, weights_t.transpose(-1, -2) * den.reciprocal(), key_exp


#: a query whose largest weight is below this is scaled up before its float32 product
#: (:func:`_scaled_to_float32_range`); above it the float32 weights keep their digits
FLOAT32_SCALE_BELOW = 2.0**-60


def _scaled_to_float32_range(weights_t: torch.Tensor, den: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``(W, d)`` with each query's column of ``W (R, ..., C, N)`` and its normalizer ``d (R, ..., N, 1)`` scaled
    by one power of two, :math:`2^{-e_n}` with :math:`\max_c |W_{cn}| = m\,2^{e_n}`, :math:`m \in [1/2, 1)`, where
    that largest weight is below :data:`FLOAT32_SCALE_BELOW` (tiny weights of a query whose weighting function is
    ~1e-180 where its exponential is largest: in float32 they were 0, and the quotient 0 / 0).

    Scaling by a power of two is exact and cancels in :math:`W^	op E / d`; the other columns are multiplied by 1,
    the same bits, and their float32 quotient is unchanged."""
    largest = weights_t.abs().amax(-2, keepdim=True)  # (R, ..., 1, N)
    exponent = torch.frexp(largest).exponent
    small = (largest > 0) & (largest < FLOAT32_SCALE_BELOW)
    scale = torch.where(small, torch.ldexp(torch.ones_like(largest), -exponent), torch.ones_like(largest))
    return weights_t * scale, den * scale.transpose(-1, -2)


def float32_quotient_bound(weights_t: torch.Tensor, key_exp: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    r"""Bound on the row error of :math:`\mathrm{fl_{32}}(\mathrm{fl_{32}}(W)^\top \mathrm{fl_{32}}(E)) \cdot \mathrm{fl_{32}}(1/d)`.

    For ``W (R, ..., C, N)``, ``E (R, ..., C, M)`` with :math:`|E| \le 1` and the normalizer
    ``d (R, ..., N)``, the float32 quotient :math:`\tilde P_n` of :func:`estimate_with_float32_probabilities`
    satisfies, for the exact :math:`\hat P_{nm} = \sum_c W_{cn} E_{cm} / d_n`,

    .. math::
        \|\tilde P_n - \hat P_n\|_2 \le \frac{g \sum_c |W_{cn}|\,\|E_c\|_2
        + \sqrt{M}\,\eta\,(C \max_c |W_{cn}| + 3C + 1)}{|d_n|} + \sqrt{M}\,\eta,

    with :math:`g = (\gamma_C (1+u)^2 + 2u + u^2)(1+u)^3 + (1+u)^3 - 1`, :math:`\gamma_C = Cu / (1 - Cu)`,
    :math:`u = 2^{-24}` and :math:`\eta = 2^{-150}`. Why: an inner product of length C in any
    order (blocked, FMA) errs by at most :math:`\gamma_C \sum_c |a_c b_c|` (Higham, *Accuracy and
    Stability of Numerical Algorithms*, 2nd ed., eq. 3.5); rounding :math:`W, E` to float32 adds
    :math:`2u + u^2` relative, and the float64 reciprocal, its rounding to float32 and the product
    by it at most :math:`(1+u)^3` (also on :math:`|\hat P_{nm}| \le \sum_c |W_{cn}| E_{cm} / |d_n|`); the
    :math:`\eta` terms bound the absolute error of each rounding that underflows (conversions,
    products, sums, the final product); the row norm follows by the triangle inequality,
    :math:`\|\sum_c |W_{cn}| E_c\|_2 \le \sum_c |W_{cn}| \|E_c\|_2`. The bound is worst-case: on
    DINOv2 (785 tokens, C = 16 .. 128) the actual error was 100 to 1000 times smaller.
    """
    num_c, num_k = key_exp.shape[-2], key_exp.shape[-1]
    u = _U32
    gamma = num_c * u / (1.0 - num_c * u)
    g = (gamma * (1 + u) ** 2 + 2 * u + u * u) * (1 + u) ** 3 + (1 + u) ** 3 - 1
    abs_w = weights_t.abs()
    spread = (abs_w.transpose(-1, -2) @ torch.linalg.vector_norm(key_exp, dim=-1, keepdim=True))[..., 0]
    underflow = math.sqrt(num_k) * _ETA32 * (num_c * abs_w.amax(-2) + 3 * num_c + 1)
    return (g * spread + underflow) / den.abs() + math.sqrt(num_k) * _ETA32


def _output(weights_t: torch.Tensor, key_exp: torch.Tensor, v: torch.Tensor, signed: bool,
            in_dtype: torch.dtype) -> torch.Tensor:
    """eq. 28 from the query weights and key exponentials: one product ``E [v, 1]``, one ``W^T (.)``, a division."""
    dim_v = v.shape[-1]
    # [E v, E 1] : (R, ..., C, Dv + 1)
    v_one = v.new_empty((*v.shape[:-1], dim_v + 1))
    v_one[..., :dim_v] = v
    v_one[..., dim_v] = 1.0
    key_stats = key_exp @ v_one.unsqueeze(0)
    sums = weights_t.transpose(-1, -2) @ key_stats  # (R, ..., N, Dv + 1)
    return _normalize(sums[..., :-1], sums[..., -1:], signed, in_dtype)


def _implied_probabilities(weights_t: torch.Tensor, key_exp: torch.Tensor, signed: bool,
                           in_dtype: torch.dtype) -> torch.Tensor:
    r""":math:`W^\top E / (W^\top E\,1)`, ``(R, ..., N, M)``."""
    den = _normalizer(weights_t, key_exp, signed)
    num = weights_t.transpose(-1, -2) @ key_exp  # (R, ..., N, M)
    if num.dtype != in_dtype:
        return _normalize(num, den, False, in_dtype)
    # in place, by the reciprocal: an (N, M) division in float64 cost a third of signed LARA's time
    return num.mul_(den.reciprocal_())


def _normalizer(weights_t: torch.Tensor, key_exp: torch.Tensor, signed: bool) -> torch.Tensor:
    r"""The implied probabilities' normalizer :math:`W^\top E\,1`, ``(R, ..., N, 1)``; warns where it is not positive."""
    den = weights_t.transpose(-1, -2) @ key_exp.sum(-1, keepdim=True)
    if signed:
        _warn_non_positive(torch.sign(den[..., 0]))
    return den


def _normalize(num: torch.Tensor, den: torch.Tensor, signed: bool, in_dtype: torch.dtype) -> torch.Tensor:
    if signed:
        _warn_non_positive(torch.sign(den[..., 0]))
    # the division writes the result in the caller's dtype directly (one pass, no float64 copy)
    return torch.div(num, den, out=torch.empty(num.shape, dtype=in_dtype, device=num.device))


def _weights_and_keys(q: Any, k: Any, v: Any, draws: Draws,
                      options: LaraOptions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool, torch.dtype]:
    """Query weights ``W (R, ..., C, N)`` and key exponentials ``E (R, ..., C, M)`` of :func:`estimate`.

    Also the prepared values, whether the weights are signed, and the caller's dtype.
    """
    weighting, beta, alpha_clamp = options.weighting, options.beta, options.alpha_clamp
    signed = options.signed
    in_dtype = q.dtype if isinstance(q, torch.Tensor) else torch.float64
    if signed and in_dtype in (torch.float32, torch.float16, torch.bfloat16):
        # before the temperature scaling, so that x = sqrt(scale) q is not rounded to float32 either
        q, k, v = (a.to(torch.float64) if isinstance(a, torch.Tensor) else a for a in (q, k, v))
    x, y, v, x_lm, omega, log_q = _proposals(q, k, v, draws, options)
    dim = x.shape[-1]
    # keys: E = exp(log xi(y_m, omega_c) - s_c) : (R, ..., C, M)
    key_log = omega @ y.transpose(-1, -2).unsqueeze(0)
    key_log.sub_((0.5 * torch.linalg.vector_norm(y, dim=-1).square()).unsqueeze(-2).unsqueeze(0))
    key_shift = key_log.amax(-1, keepdim=True)
    key_exp = key_log.sub_(key_shift).exp_()
    # per-sample log terms: log N(omega_c; 0, I) - log q_c(omega_c) + s_c : (R, ..., C)
    log_q_own = torch.diagonal(log_q, dim1=-2, dim2=-1)
    row = _log_gaussian((omega * omega).sum(-1), dim) - log_q_own + key_shift.squeeze(-1)
    per_query = weighting in ("decoupled", "coupled")
    if not per_query:
        log_alpha = _log_alpha_at_samples(log_q, x[..., :1, :1].expand(*x.shape[:-2], 1, 1), weighting, beta,
                                          alpha_clamp)[0][..., 0, :]  # (R, ..., C): the same for every n
        row = row + log_alpha
    # queries: exp(omega_c . x_n + row_c - max_c) : (R, ..., C, N)
    exponents = omega @ x.transpose(-1, -2).unsqueeze(0)
    exponents.add_(row.unsqueeze(-1))
    exponents.sub_(exponents.amax(-2, keepdim=True))
    if not per_query:
        return exponents.exp_(), key_exp, v, signed, in_dtype
    alpha = _query_weights_t(x, x_lm, log_q, weighting, beta, alpha_clamp)
    weights = exponents.exp().mul_(alpha)  # the exponents kept for the queries whose products underflow
    weights = _rescue_underflowed_queries(weights, alpha, exponents, beta, alpha_clamp)
    return weights, key_exp, v, signed, in_dtype


#: device types on which :func:`_rescue_underflowed_queries` asks whether any query underflowed before redoing it (a
#: free read on the host); elsewhere it computes the log form for every query, as it must not read a value back
ASK_FIRST_DEVICES = ("cpu",)


def _rescue_underflowed_queries(weights: torch.Tensor, alpha: torch.Tensor, exponents: torch.Tensor, beta: float,
                                alpha_clamp: float | None) -> torch.Tensor:
    r"""The query-dependent weights :math:`W_{cn} = \alpha_{nc} e^{P_{cn}}` redone in log space for the queries whose
    linear form underflowed, ``(R, ..., C, N)``; the others are returned as they were (the same bits).
    ``exponents`` are :math:`P_{cn} - \max_{c'} P_{c'n}`, those of ``weights``; they are overwritten.

    :func:`_weights_and_keys` shifts :math:`P_{cn}` by its maximum over c before multiplying
    :math:`\alpha_{nc}` in. When :math:`\alpha` is zero or tiny at that maximum (e.g. one-hot scores
    :math:`r'_{n\cdot}` with N(0, I) proposals, where eq. 38 gives :math:`1/C - 1/C = 0`, at query
    and key norms ~1e3) while :math:`P` spreads over more than ~700 across c, every other product
    underflows: a zero column (0/0, NaN) or subnormal ones (digits lost). The reference
    stays finite: it takes the maximum of :math:`\log|\alpha_{nc}| + P_{cn}`, signs apart. For such
    a column n this does the same, :math:`W_{cn} = \operatorname{sign}\alpha_{nc}
    \exp(P_{cn} + \log|\alpha_{nc}| - \max_{c'}(\cdot))`; each column's scale cancels in eq. 28.

    Which columns: those whose largest :math:`|W_{cn}|` is below ``tiny * 2**64 * A``, with
    :math:`A = \max(1 + |\beta|, \text{alpha\_clamp})` a bound on :math:`|\alpha|` (eq. 38:
    :math:`b \le 1`, :math:`|r' - \bar r'| \le 1`; eq. 37, where :math:`\beta = 1`:
    :math:`q_c \le (2\pi)^{-D/2} \le 1`). Above it every product within :math:`2^{-60}` of the
    column's largest has a normal exponential (at least ``16 tiny``) and is a normal product, so the
    linear form keeps its full precision (what it drops is below :math:`2^{-60}` of the largest term);
    below it the log form is taken. On ordinary inputs no column is below it and the linear form is
    kept: the outputs are the same bits as without this step.
    """
    tiny = torch.finfo(weights.dtype).tiny
    threshold = tiny * 2.0**64 * max(1.0 + abs(beta), alpha_clamp or 0.0)
    # max_c |W_cn| < threshold, as two reductions (an order of magnitude faster than vector_norm's inf norm on CPU)
    low = (weights.amax(-2, keepdim=True) < threshold) & (weights.amin(-2, keepdim=True) > -threshold)  # (R, ..., 1, N)
    if weights.device.type in ASK_FIRST_DEVICES and not bool(low.any()):
        # a free read on the host (the common case: nothing to redo); on an accelerator it would synchronise every
        # call, so there the log form is computed for every query and kept where low (tests/gpu exercise both)
        return weights
    log_terms = exponents.add_(alpha.abs().log())  # log 0 = -inf: a zero weight (the exponents are not read again)
    shift = log_terms.amax(-2, keepdim=True)
    # every weight zero: no shift, and 0/0 as in the reference (with its NonPositiveDenominatorWarning)
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    rescued = log_terms.sub_(shift).exp_().mul_(torch.sign(alpha))
    return torch.where(low, rescued, weights)


def weighted_log_features(terms: LaraTerms) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """torch form of ``reference.weighted_log_features``: ``(log_qf, log_kf, q_sign)`` of LARA's eq. 28."""
    omega, x, y = terms.omega, terms.x, terms.y
    log_std_normal = _log_gaussian((omega * omega).sum(-1), x.shape[-1])  # (R, ..., C)
    log_q_own = torch.diagonal(terms.log_proposals, dim1=-2, dim2=-1)
    log_alpha_prime = terms.log_abs_alpha + (log_std_normal - log_q_own).unsqueeze(-2)
    log_qf, _ = positive_log_features(x.unsqueeze(0), omega)  # (R, ..., N, C, 1)
    log_kf, _ = positive_log_features(y.unsqueeze(0), omega)  # (R, ..., M, C, 1)
    q_sign = None if terms.alpha_sign is None else terms.alpha_sign.unsqueeze(-1)
    return log_qf + log_alpha_prime.unsqueeze(-1), log_kf, q_sign


# ----------------------------------------------------------------------------------------
# quadratic literal forms (torch), for identities on the batched path
# ----------------------------------------------------------------------------------------


def log_target_density(x: torch.Tensor, y: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
    """``log p_n(omega_c)`` (R, ..., N, C) of the RA mixture; see ``reference.log_target_density``."""
    log_pi = torch.log_softmax(x @ y.transpose(-1, -2), dim=-1).unsqueeze(0).unsqueeze(-2)  # (1, ..., N, 1, M)
    return torch.logsumexp(log_pi + _log_gaussian(_sq_dist_to_mixture_means(omega, x, y), x.shape[-1]), dim=-1)


def log_unnormalized_target(x: torch.Tensor, y: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
    """``log p~_n(omega_c)`` (R, ..., N, C); see ``reference.log_unnormalized_target``."""
    lx, _ = positive_log_features(x.unsqueeze(0), omega)
    ly, _ = positive_log_features(y.unsqueeze(0), omega)
    log_std_normal = _log_gaussian((omega * omega).sum(-1), omega.shape[-1])
    return log_std_normal.unsqueeze(-2) + lx[..., 0] + torch.logsumexp(ly[..., 0], dim=-2).unsqueeze(-2)


def f_values(x: torch.Tensor, y: torch.Tensor, v: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
    """``f_n(omega_c)`` (R, ..., N, C, Dv) of eq. 6; see ``reference.f_values``."""
    lx, _ = positive_log_features(x.unsqueeze(0), omega)
    ly, _ = positive_log_features(y.unsqueeze(0), omega)
    logits = lx[..., 0].unsqueeze(-1) + ly[..., 0].transpose(-1, -2).unsqueeze(-3)  # (R, ..., N, C, M)
    return torch.softmax(logits, dim=-1) @ v.unsqueeze(0).unsqueeze(-3)


def _signed_weighted_sum(log_abs: torch.Tensor, sign: torch.Tensor | None, f: torch.Tensor):
    shift = log_abs.amax(dim=-1, keepdim=True)
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    w = torch.exp(log_abs - shift)
    if sign is not None:
        w = w * sign
    return (w.unsqueeze(-2) @ f).squeeze(-2), w.sum(-1), shift.squeeze(-1)


def snis_estimate_eq10(terms: LaraTerms) -> torch.Tensor:
    """Literal eq. 10 (quadratic), (R, ..., N, Dv); see ``reference.snis_estimate_eq10``."""
    log_w = terms.log_abs_alpha + log_unnormalized_target(terms.x, terms.y, terms.omega) \
        - torch.diagonal(terms.log_proposals, dim1=-2, dim2=-1).unsqueeze(-2)
    num, den, _ = _signed_weighted_sum(log_w, terms.alpha_sign, f_values(terms.x, terms.y, terms.v, terms.omega))
    return num / den.unsqueeze(-1)


def mis_estimate_eq8(terms: LaraTerms) -> torch.Tensor:
    """Eq. 8 with the exact p_n (quadratic), (R, ..., N, Dv); see ``reference.mis_estimate_eq8``."""
    log_w = terms.log_abs_alpha + log_target_density(terms.x, terms.y, terms.omega) \
        - torch.diagonal(terms.log_proposals, dim1=-2, dim2=-1).unsqueeze(-2)
    num, _, shift = _signed_weighted_sum(log_w, terms.alpha_sign, f_values(terms.x, terms.y, terms.v, terms.omega))
    return num * torch.exp(shift).unsqueeze(-1)
