"""LARA in torch (batched form of ``lara.reference``): same signatures, layouts and draws.

Vectorized over replicates, batch dims, queries and proposals; the weighting functions are
formed only at each proposal's own sample (``(R, ..., N, C)``) instead of at every sample.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from randattn.estimators._prepare import check_draw_array, prepare_batched, to_torch_draws
from randattn.estimators.base import Draws
from randattn.estimators.features.batched import positive_log_features
from randattn.estimators.lara.reference import (
    LaraTerms,
    _warn_non_positive,
    check_lara_params,
    effective_proposals,
    landmarks,
)
from randattn.estimators.ra.reference import noise_std
from randattn.estimators.segments import segment_means_torch
from randattn.estimators.snis.batched import feature_attention

__all__ = [
    "lara_terms",
    "estimate",
    "log_target_density",
    "log_unnormalized_target",
    "f_values",
    "snis_estimate_eq10",
    "mis_estimate_eq8",
]

_LOG_2PI = math.log(2.0 * math.pi)


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


def _sq_dist_to_mixture_means(omega: torch.Tensor, centre: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``|omega_j - centre_i - y_m|^2`` : (R, ..., I, J, M) for omega (R, ..., J, D), centre (..., I, D)."""
    d = omega.unsqueeze(-3) - centre.unsqueeze(0).unsqueeze(-2)  # (R, ..., I, J, D)
    omega_y = omega @ y.transpose(-1, -2).unsqueeze(0)  # (R, ..., J, M)
    centre_y = centre @ y.transpose(-1, -2)  # (..., I, M)
    y_sq = (y * y).sum(-1)
    return ((d * d).sum(-1).unsqueeze(-1) - 2.0 * omega_y.unsqueeze(-3)
            + (2.0 * centre_y + y_sq.unsqueeze(-2)).unsqueeze(0).unsqueeze(-2))


def _log_proposal_densities(
    omega: torch.Tensor, x_lm: torch.Tensor, y: torch.Tensor, mu: torch.Tensor, proposal: str
) -> torch.Tensor:
    """``log q_c'(omega_j)`` (R, ..., C', J); see ``reference.log_proposal_densities``."""
    dim = omega.shape[-1]
    if proposal != "eq32":
        diff = omega.unsqueeze(-3) - mu.unsqueeze(0).unsqueeze(-2)  # (R, ..., C', J, D)
        return _log_gaussian((diff * diff).sum(-1), dim)
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


def lara_terms(
    q: Any,
    k: Any,
    v: Any,
    draws: Draws,
    *,
    scale: float | None = None,
    proposal: str = "eq34",
    weighting: str = "decoupled",
    beta: float = 1.0,
    alpha_clamp: float | None = None,
    sample: str = "random",
    noise: str = "paper",
    layout: str = "grid",
    grid: Any = None,
    prefix_tokens: int = 0,
) -> LaraTerms:
    """Torch form of ``reference.lara_terms`` (tensors in a :class:`~randattn.estimators.lara.reference.LaraTerms`)."""
    check_lara_params(proposal, weighting, beta, alpha_clamp, sample, noise, layout, grid, prefix_tokens)
    layout_kw = dict(layout=layout, grid=grid, prefix_tokens=prefix_tokens)
    x, y, v, scale, batch = prepare_batched(q, k, v, scale)
    sigma = noise_std(noise, scale)
    num_q, num_k, dim = x.shape[-2], y.shape[-2], x.shape[-1]
    draws = to_torch_draws(draws, x)
    if sample == "mean":
        drawn = check_draw_array(draws, "proposal_slots", batch, (None, 0)).shape[-2]
    else:
        drawn = check_draw_array(draws, "eps", batch, (None, dim)).shape[-2]
    num_c = effective_proposals(num_q, num_k, drawn, proposal, **layout_kw)
    x_lm, y_lm = landmarks(x, y, num_c, proposal, means=segment_means_torch, **layout_kw)
    mu = _proposal_means(x_lm, y_lm, y, proposal)
    if sample == "mean":
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
    scores = torch.softmax(x @ x_lm.transpose(-1, -2), dim=-2)  # r'_nc, softmax over queries n
    log_abs_alpha, alpha_sign = _log_alpha_at_samples(log_q, scores, weighting, beta, alpha_clamp)
    return LaraTerms(x, y, v, omega, log_q, log_abs_alpha, alpha_sign, x_lm)


def estimate(
    q: Any,
    k: Any,
    v: Any,
    draws: Draws,
    *,
    scale: float | None = None,
    proposal: str = "eq34",
    weighting: str = "decoupled",
    beta: float = 1.0,
    alpha_clamp: float | None = None,
    sample: str = "random",
    noise: str = "paper",
    layout: str = "grid",
    grid: Any = None,
    prefix_tokens: int = 0,
) -> torch.Tensor:
    """LARA over (R, ..., N, Dv); same signature, draws and layout as ``lara.reference.estimate``."""
    terms = lara_terms(
        q, k, v, draws, scale=scale, proposal=proposal, weighting=weighting, beta=beta,
        alpha_clamp=alpha_clamp, sample=sample, noise=noise, layout=layout, grid=grid, prefix_tokens=prefix_tokens,
    )  # fmt: skip
    omega, x, y = terms.omega, terms.x, terms.y
    log_std_normal = _log_gaussian((omega * omega).sum(-1), x.shape[-1])  # (R, ..., C)
    log_q_own = torch.diagonal(terms.log_proposals, dim1=-2, dim2=-1)
    log_alpha_prime = terms.log_abs_alpha + (log_std_normal - log_q_own).unsqueeze(-2)
    log_qf, _ = positive_log_features(x.unsqueeze(0), omega)  # (R, ..., N, C, 1)
    log_kf, _ = positive_log_features(y.unsqueeze(0), omega)  # (R, ..., M, C, 1)
    q_sign = None if terms.alpha_sign is None else terms.alpha_sign.unsqueeze(-1)
    out, sign = feature_attention(log_qf + log_alpha_prime.unsqueeze(-1), log_kf, v.unsqueeze(0), q_sign=q_sign)
    if q_sign is not None:
        _warn_non_positive(sign)
    return out


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
