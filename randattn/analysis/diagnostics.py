r"""Importance-sampling diagnostics: Kish ESS, delta-method variance and Pareto k-hat.

Scope (honest and generic): the diagnostics need the estimator's self-normalized importance
weights. They are available for ``rfa`` with a positive feature map (``positive``,
``hyperbolic``, ``regularized``, ``oprf``), where ARCHITECTURE sec. 4 gives them in closed
form from the draws,

.. math::
    w_{ns} = \mathrm{softmax}_s\Big(\log\xi(x_n, \omega_s) + \operatorname{logsumexp}_m \log\xi(y_m, \omega_s)\Big),
    \qquad
    f(\omega_s) = \sum_m \mathrm{softmax}_m\big(\log\xi(y_m, \omega_s)\big)\, v_m,

computed from log-features (never N x M). For maps with L > 1 features per sample (hyperbolic)
the ``S L`` feature columns are the "samples". ``lara`` provides the same from its eq. 28 weights
``alpha'_nc xi(x_n, w_c) sum_m xi(y_m, w_c)`` (one sample per proposal) when they are all
positive (balance, coupled, constant, clamped weighting); signed decoupled weights and every other
estimator (EVA's one-sample chunk coefficients have no weights to diagnose; signed trigonometric
features) report NaN. Where the weights come from is the estimator's own declaration,
:attr:`~randattn.estimators.base.EstimatorSpec.importance_weights`: a plugin that declares it is
diagnosed like the built-ins.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np
from scipy.special import logsumexp

from randattn._tensors import input_tensor
from randattn.estimators.registry import get_spec

__all__ = [
    "KHAT_THRESHOLD",
    "KHAT_MIN_WEIGHTS",
    "IsDiagnostics",
    "snis_diagnostics",
    "delta_method_spread",
    "estimator_diagnostics",
    "pareto_khat",
    "ReplicateDiagnostics",
    "replicate_snis_diagnostics",
]

#: k-hat above which the Monte Carlo variance estimate is not to be trusted (Vehtari et al. 2024, sec. 3)
KHAT_THRESHOLD = 0.7
#: importance weights per query below which k-hat is not fitted: arviz's tail of ceil(min(J/5, 3 sqrt J))
#: weights needs 5 of them (it returns inf below)
KHAT_MIN_WEIGHTS = 25


@dataclass(frozen=True)
class IsDiagnostics:
    """Importance-sampling diagnostics per batch element, each field ``(...)``.

    Attributes
    ----------
    ess_mean : (...) ndarray
        Kish ESS of the normalized weights per query, averaged over queries and replicates.
    ess_min : (...) ndarray
        Smallest per-query ESS over queries and replicates.
    delta_variance : (...) ndarray
        Delta-method variance of the SNIS output (Owen 2013 sec. 9.2), averaged over
        queries, value dims and replicates: compare with the replicate variance.
    pareto_khat : (...) ndarray
        Mean over the examined queries of the PSIS shape estimate k-hat (first replicate).
    khat_max : (...) ndarray
        Largest k-hat over the examined queries.
    khat_frac_high : (...) ndarray
        Fraction of examined queries with k-hat > :data:`KHAT_THRESHOLD`.
    num_weights : int
        Number of importance weights per query (S L).
    """

    ess_mean: np.ndarray
    ess_min: np.ndarray
    delta_variance: np.ndarray
    pareto_khat: np.ndarray
    khat_max: np.ndarray
    khat_frac_high: np.ndarray
    num_weights: int

    @property
    def untrustworthy(self) -> np.ndarray:
        """Flag: some examined query has k-hat > 0.7, so replicate and delta-method variances are unreliable."""
        with np.errstate(invalid="ignore"):
            return np.asarray(self.khat_max > KHAT_THRESHOLD)


def nan_diagnostics(batch: tuple[int, ...]) -> IsDiagnostics:
    """All-NaN diagnostics for estimators whose weights are not accessible."""
    nan = np.full(batch, np.nan)
    return IsDiagnostics(nan, nan.copy(), nan.copy(), nan.copy(), nan.copy(), nan.copy(), 0)


def _arviz_tail_length(num: int) -> int:
    """Tail size used by ``arviz.psislw`` for ``num`` weights (it returns k = inf below 5)."""
    return int(math.ceil(min(0.2 * num, 3.0 * math.sqrt(num))))


def pareto_khat(log_weights: Any) -> np.ndarray:
    r"""PSIS shape estimate :math:`\hat k` per row of log importance weights.

    Parameters
    ----------
    log_weights : (..., J) array_like
        Unnormalized log weights; J is the sample axis.

    Returns
    -------
    (...) ndarray
        :math:`\hat k` as ``arviz.psislw`` computes it (generalized Pareto fit to the largest
        ``ceil(min(J/5, 3 sqrt J))`` weights, Zhang & Stephens 2009 with the PSIS prior),
        vectorized over rows: :func:`_gpd_shape_rows` is arviz's ``_gpdfit`` written for a
        ``(rows, tail)`` array (arviz and arviz-stats loop over rows in Python, ~1 ms per
        row, which dominated small sweeps). Rows the vectorized form does not cover (ties at
        the cutoff, a cutoff below ``log(tiny)``, non-finite weights in the tail) go to
        ``arviz.psislw`` itself, which is also the judge in the tests. NaN when the tail has
        fewer than 5 weights (J < 25): arviz returns inf there, which is not an estimate.

    Notes
    -----
    :math:`\hat k < 0.5`: finite variance, fine; :math:`0.5 \le \hat k \le 0.7`: finite mean,
    slower convergence; :math:`\hat k > 0.7`: the variance estimates (replicate and delta
    method) cannot be trusted.

    References
    ----------
    Vehtari, Simpson, Gelman, Yao, Gabry (2024), Pareto smoothed importance sampling,
    JMLR 25(72), sec. 3; Zhang & Stephens (2009), Technometrics 51(3).
    """
    lw = np.asarray(log_weights, dtype=np.float64)
    batch = lw.shape[:-1]
    num = lw.shape[-1]
    tail = _arviz_tail_length(num)
    if tail <= 4:
        return np.full(batch, np.nan)
    rows = np.where(np.isfinite(lw), lw, -np.inf).reshape(-1, num)
    k = np.full(rows.shape[0], np.nan)
    if rows.shape[0] == 0:
        return k.reshape(batch)
    with np.errstate(invalid="ignore", over="ignore"):
        x = np.sort(rows - rows.max(-1, keepdims=True), axis=-1)
    cutoff = x[:, num - tail - 1]
    # the vectorized fit needs exactly `tail` weights strictly above a finite cutoff above log(tiny)
    plain = (np.isfinite(x[:, num - tail :]).all(-1) & np.isfinite(cutoff) & (cutoff > _LOG_TINY)
             & (x[:, num - tail] > cutoff))
    if plain.any():
        tails = np.exp(x[plain, num - tail :]) - np.exp(cutoff[plain])[:, None]
        k[plain] = _gpd_shape_rows(tails)
    rest = ~plain & np.isfinite(x[:, -1])
    if rest.any():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # arviz's import-time FutureWarning and fit warnings
            import arviz

            _, k_rest = arviz.psislw(np.ascontiguousarray(rows[rest]))
        k[rest] = np.asarray(k_rest, dtype=np.float64)
    return np.where(np.isfinite(k), k, np.nan).reshape(batch)


_LOG_TINY = float(np.log(np.finfo(float).tiny))


def _gpd_shape_rows(tails: np.ndarray) -> np.ndarray:
    r"""Empirical-Bayes GPD shape of each row of ascending exceedances ``(B, n)`` (arviz ``_gpdfit``).

    Zhang & Stephens (2009): a grid of :math:`m = 30 + \lfloor\sqrt n\rfloor` values of
    :math:`b = -k/\sigma`, profile log-likelihood weights, posterior mean of b, then
    :math:`\hat k = \mathrm{mean}\log(1 - b x)` shrunk towards 0.5 with the PSIS prior
    :math:`(n \hat k + 10 \cdot 0.5)/(n + 10)`. Grid weights below ``10 eps`` are dropped
    (set to 0) before normalizing, as arviz does.
    """
    n = tails.shape[-1]
    m = 30 + int(n**0.5)
    grid = 1.0 - np.sqrt(m / (np.arange(1, m + 1, dtype=float) - 0.5))  # (m,)
    b = grid[None, :] / (3.0 * tails[:, int(n / 4 + 0.5) - 1])[:, None] + 1.0 / tails[:, -1][:, None]  # (B, m)
    k_grid = np.log1p(-b[:, :, None] * tails[:, None, :]).mean(-1)  # (B, m)
    log_lik = n * (np.log(-(b / k_grid)) - k_grid - 1.0)
    weights = 1.0 / np.exp(log_lik[:, None, :] - log_lik[:, :, None]).sum(-1)
    weights = np.where(weights >= 10 * np.finfo(float).eps, weights, 0.0)
    weights /= weights.sum(-1, keepdims=True)
    b_post = (b * weights).sum(-1)
    k_post = np.log1p(-b_post[:, None] * tails).mean(-1)
    return (n * k_post + 10 * 0.5) / (n + 10)


def delta_method_spread(weights: Any, f: Any) -> Any:
    r"""The delta-method sum :math:`\sum_j w_{nj}^2 \|f_j - \mu_n\|^2` per query, without cancellation.

    Parameters
    ----------
    weights : (..., N, J) torch.Tensor, float64
        Normalized weights :math:`w_{nj}` (each row sums to 1).
    f : (..., J, Dv) torch.Tensor, float64
        Per-sample values, with the leading dims of ``weights``.

    Returns
    -------
    (..., N) torch.Tensor
        :math:`\sum_j w_{nj}^2 \|f_j - \mu_n\|^2` with :math:`\mu_n = \sum_j w_{nj} f_j`; summed over Dv
        (divide by Dv for the per-element average of :func:`snis_delta_method_variance
        <randattn.theory.montecarlo.snis_delta_method_variance>`). NaN rows stay NaN.

    Notes
    -----
    The plain expansion :math:`\sum_j w_j^2\|f_j\|^2 - 2\mu\cdot\sum_j w_j^2 f_j + \|\mu\|^2 \sum_j w_j^2`
    cancels catastrophically when one weight holds almost all the mass (ESS near 1, as for RFA on
    the early layers of a ViT): its terms are about :math:`\|f\|^2` while the sum is about
    :math:`\delta^2 \|\Delta f\|^2`, with :math:`\delta = 1 - \max_j w_j` as small as 1e-40; on DINOv2 it
    returned rounding noise up to 1e15 times the true value. Here each query's largest weight
    :math:`w_p` is the pivot: with :math:`\tilde w = w` but :math:`\tilde w_p = 0`,
    :math:`s = \sum_k \tilde w_k` and :math:`s_2 = \sum_k \tilde w_k^2` (sums of the small weights, never
    :math:`1 - w_p`), :math:`\mu - f_p = \sum_k \tilde w_k (f_k - f_p)` and

    .. math::
        \sum_j w_j^2 \|f_j - \mu\|^2 = \sum_k \tilde w_k^2 \|f_k - f_p\|^2
        - 2 (\mu - f_p) \cdot \sum_k \tilde w_k^2 (f_k - f_p) + \|\mu - f_p\|^2 (w_p^2 + s_2),

    in which every term carries a factor of the small weights. ``f`` is first centred on its mean
    over samples (the sum is shift-invariant), and the products are taken through the Gram matrix
    :math:`G = f f^T` where ``J <= Dv`` (one (N, J) x (J, J) product) and through ``f`` otherwise
    (two (N, J) x (J, Dv) products, as the expansion took): the rounding error is about
    :math:`\epsilon J^2` of the result times :math:`\max_j\|f_j - \bar f\|^2 / \|\Delta f\|^2`, with no
    :math:`1/\delta`.
    """
    import torch

    f = (f - f.mean(-2, keepdim=True)).expand(*weights.shape[:-2], *f.shape[-2:])
    pivot = weights.argmax(-1, keepdim=True)  # (..., N, 1): each query's largest weight
    w_p = torch.gather(weights, -1, pivot).squeeze(-1)
    rest = weights.scatter(-1, pivot, 0.0)
    rest2 = rest.square()
    s, s2 = rest.sum(-1), rest2.sum(-1)
    if f.shape[-2] <= f.shape[-1]:
        near, dev_dot, dev_sq = _pivoted_sums_by_gram(f, pivot, rest, rest2, s, s2)
    else:
        near, dev_dot, dev_sq = _pivoted_sums_by_values(f, pivot, rest, rest2, s, s2)
    return (near - 2.0 * dev_dot + dev_sq * (w_p * w_p + s2)).clamp_min(0.0)


def _pivoted_sums_by_gram(f, pivot, rest, rest2, s, s2):
    r""":math:`\sum_k \tilde w_k^2 \|f_k - f_p\|^2`, :math:`(\mu - f_p) \cdot \sum_k \tilde w_k^2 (f_k - f_p)` and
    :math:`\|\mu - f_p\|^2` per query, through :math:`G = f f^T` (for ``J <= Dv``)."""
    import torch

    gram = f @ f.transpose(-1, -2)  # (..., J, J)
    g_p = torch.gather(gram, -2, pivot.expand(*pivot.shape[:-1], gram.shape[-1]))  # (..., N, J): the rows G[p_n]
    g_pp = torch.gather(g_p, -1, pivot).squeeze(-1)
    a = rest @ gram
    w_gp, w2_gp = torch.linalg.vecdot(rest, g_p), torch.linalg.vecdot(rest2, g_p)
    near = (rest2 @ torch.diagonal(gram, dim1=-2, dim2=-1).unsqueeze(-1)).squeeze(-1) - 2.0 * w2_gp + s2 * g_pp
    dev_dot = torch.linalg.vecdot(a, rest2) - s2 * w_gp - s * w2_gp + s * s2 * g_pp
    dev_sq = torch.linalg.vecdot(a, rest) - 2.0 * s * w_gp + s * s * g_pp
    return near, dev_dot, dev_sq


def _pivoted_sums_by_values(f, pivot, rest, rest2, s, s2):
    """The sums of :func:`_pivoted_sums_by_gram` through ``f`` itself (for ``J > Dv``)."""
    import torch

    f_p = torch.gather(f.unsqueeze(-3).expand(*pivot.shape[:-1], *f.shape[-2:]), -2,
                       pivot.unsqueeze(-1).expand(*pivot.shape, f.shape[-1])).squeeze(-2)  # (..., N, Dv)
    sq_norms = f.square().sum(-1)  # (..., J)
    g_pp = torch.gather(sq_norms, -1, pivot.squeeze(-1))  # ||f_p||^2
    a = rest @ f  # mu - f_p = a - s f_p
    u = rest2 @ f  # sum w~^2 (f - f_p) = u - s2 f_p
    a_u, p_u, a_p = torch.linalg.vecdot(a, u), torch.linalg.vecdot(f_p, u), torch.linalg.vecdot(a, f_p)
    near = (rest2 @ sq_norms.unsqueeze(-1)).squeeze(-1) - 2.0 * p_u + s2 * g_pp
    dev_dot = a_u - s * p_u - s2 * a_p + s * s2 * g_pp
    dev_sq = torch.linalg.vecdot(a, a) - 2.0 * s * a_p + s * s * g_pp
    return near, dev_dot, dev_sq


def snis_diagnostics(log_w: Any, f: Any, *, khat_queries: int = 16) -> IsDiagnostics:
    r"""Kish ESS, delta-method variance and Pareto k-hat of an SNIS estimate.

    Parameters
    ----------
    log_w : (R, ..., N, J) array_like
        Unnormalized log importance weights per replicate and query.
    f : (R, ..., J, Dv) array_like
        Per-sample values.
    khat_queries : int
        k-hat is fitted on the first replicate for at most this many queries, evenly spaced
        (``arviz.psislw`` costs ~0.4 ms per query; 0 disables it).

    Returns
    -------
    IsDiagnostics
        Fields of shape ``(...)``.

    Notes
    -----
    .. math::
        \mathrm{ESS}_n = 1 / \sum_j \bar w_{nj}^2, \qquad
        \widehat{\mathrm{Var}}_\delta[\hat y_{nd}] = \sum_j \bar w_{nj}^2 (f_{jd} - \hat y_{nd})^2 .

    The delta-method formula assumes i.i.d. samples; with orthogonal or hyperbolic
    (antithetic) couplings it ignores the negative correlation and tends to overstate the
    variance.

    References
    ----------
    Kish (1965); Owen (2013), *Monte Carlo theory, methods and examples*, sec. 9.2-9.3;
    Vehtari et al. (2024), JMLR 25(72).
    """
    log_w = np.asarray(log_w, dtype=np.float64)
    f = np.asarray(f, dtype=np.float64)
    if log_w.ndim < 3 or f.ndim != log_w.ndim or f.shape[-2] != log_w.shape[-1]:
        raise ValueError(f"log_w (R, ..., N, J) and f (R, ..., J, Dv) disagree: {log_w.shape} vs {f.shape}")
    batch = log_w.shape[1:-2]
    log_den = logsumexp(log_w, axis=-1, keepdims=True)
    weights = np.exp(log_w - log_den)  # (R, ..., N, J)
    ess = 1.0 / (weights * weights).sum(-1)  # (R, ..., N)
    ess_rn = np.moveaxis(ess, 0, -1)  # (..., N, R)
    import torch

    # f: a copy, since asarray may have returned a read-only or negatively strided view, which from_numpy refuses
    spread = delta_method_spread(torch.from_numpy(weights), torch.from_numpy(np.array(f))).numpy()
    delta = (spread.mean(-1) / f.shape[-1]).mean(0)
    num_queries = log_w.shape[-2]
    if khat_queries > 0 and num_queries > 0:
        idx = np.unique(np.linspace(0, num_queries - 1, min(khat_queries, num_queries)).round().astype(int))
        khat = pareto_khat(log_w[0][..., idx, :])  # (..., Q)
        with np.errstate(invalid="ignore"):
            if np.isnan(khat).all():
                k_mean = k_max = k_frac = np.full(batch, np.nan)
            else:
                k_mean = khat.mean(-1)
                k_max = khat.max(-1)
                k_frac = (khat > KHAT_THRESHOLD).mean(-1)
    else:
        k_mean = k_max = k_frac = np.full(batch, np.nan)
    return IsDiagnostics(
        ess_mean=ess_rn.mean(axis=(-2, -1)),
        ess_min=ess_rn.min(axis=(-2, -1)),
        delta_variance=delta,
        pareto_khat=np.asarray(k_mean, dtype=np.float64),
        khat_max=np.asarray(k_max, dtype=np.float64),
        khat_frac_high=np.asarray(k_frac, dtype=np.float64),
        num_weights=int(log_w.shape[-1]),
    )


def estimator_diagnostics(
    name: str, q: Any, k: Any, v: Any, draws: Any, *, scale: float | None, params: Mapping[str, Any], khat_queries: int = 16
) -> IsDiagnostics:
    """Diagnostics of estimator ``name`` with these draws; all-NaN when its weights are not accessible.

    Parameters
    ----------
    name : str
        Registry name.
    q : (..., N, D)
    k : (..., M, D)
    v : (..., M, Dv)
    draws : Draws
        numpy draws (as made by the spec's ``draw``).
    scale : float or None
    params : mapping
        The estimator's resolved parameters.
    khat_queries : int
        See :func:`snis_diagnostics`.

    Returns
    -------
    IsDiagnostics
        Fields ``(...)``.
    """
    batch = tuple(np.shape(q)[:-2])
    spec = get_spec(name)
    weights = spec.importance_weights if spec.diagnostics_apply(params) else None
    terms = None if weights is None else weights.reference(q, k, v, draws, scale=scale, params=params)
    if terms is None:
        return nan_diagnostics(batch)
    return snis_diagnostics(*terms, khat_queries=khat_queries)


# ------------------------------------------------------------------------------------------ per-replicate (sweep)
@dataclass(frozen=True)
class ReplicateDiagnostics:
    """Diagnostics per replicate, for the sweep (which joins replicate blocks before reducing).

    Attributes
    ----------
    ess : (R, ...) ndarray
        Kish ESS averaged over queries, per replicate.
    delta_variance : (R, ...) ndarray
        Delta-method variance averaged over queries and value dims, per replicate.
    khat : (...) ndarray or None
        Mean k-hat over the examined queries of the first replicate; None when not fitted.
    """

    ess: np.ndarray
    delta_variance: np.ndarray
    khat: np.ndarray | None


def replicate_snis_diagnostics(
    name: str, q: Any, k: Any, v: Any, draws: Any, *, scale: float | None, params: Mapping[str, Any],
    khat_queries: int = 16, backend: str = "torch", device: Any = None, dtype: str = "float64",
    mask: str | None = None,
) -> ReplicateDiagnostics | None:
    """Per-replicate ESS and delta-method variance (and k-hat) of estimator ``name``; None when undefined.

    The weights come from the spec's torch provider (``importance_weights.batched``, in
    ``dtype`` on ``device``) or, with ``backend="reference"``, from its float64 numpy one; the reductions (the formulas of :func:`snis_diagnostics`) run
    in torch float64 either way, so the sweep's numbers do not depend on how replicates are
    blocked.

    Parameters
    ----------
    name : str
    q : (..., N, D)
    k : (..., M, D)
    v : (..., M, Dv)
    draws : Draws
        numpy draws.
    scale : float or None
    params : mapping
    khat_queries : int
        Queries of the first replicate on which k-hat is fitted (0: none).
    backend : {"torch", "reference"}
    device, dtype
        Where and in which precision the torch providers run.
    mask : str, optional
        The mask the estimator ran under; passed to the provider, which must take it
        (:func:`~randattn.analysis.masking.diagnostics_skip_reason` says when it does not: the
        sweep then does not call this).
    """
    import torch

    spec = get_spec(name)
    if not spec.diagnostics_apply(params):
        return None
    weights = spec.importance_weights
    masked = {} if mask is None else {"mask": mask}
    if backend == "reference":
        provider = weights.reference_per_element or weights.reference
        terms = None if provider is None else provider(q, k, v, draws, scale=scale, params=params, **masked)
        if terms is None:
            return None
        log_w, f = (torch.from_numpy(np.ascontiguousarray(t)) for t in terms)
    else:
        provider = weights.batched
        dt = getattr(torch, dtype)
        tq, tk, tv = (input_tensor(np.asarray(a), device=device, dtype=dt) for a in (q, k, v))
        with torch.no_grad():
            terms = provider(tq, tk, tv, draws.to_torch(device=device, dtype=dt), scale=scale, params=params, **masked)
        if terms is None:
            return None
        log_w, f = (t.to(torch.float64) for t in terms)
    with torch.no_grad():
        weights = torch.softmax(log_w, dim=-1)  # (R, ..., N, J)
        ess = weights.square().sum(-1).reciprocal().mean(-1)  # (R, ...)
        delta = delta_method_spread(weights, f).mean(-1) / f.shape[-1]
    khat = None
    num_queries = log_w.shape[-2]
    if khat_queries > 0 and num_queries > 0:
        idx = np.unique(np.linspace(0, num_queries - 1, min(khat_queries, num_queries)).round().astype(int))
        per_query = pareto_khat(log_w[0][..., torch.as_tensor(idx, device=log_w.device), :].cpu().numpy())
        khat = per_query.mean(-1)  # NaN when any examined query has none (J < 25), as snis_diagnostics
    return ReplicateDiagnostics(ess.cpu().numpy(), delta.cpu().numpy(), khat)
