r"""Linear randomized attention, LARA, in numpy float64 (reference form).

Every quantity is the literal equation of LARA (Zheng et al., ICML 2022) in the paper's
variables ``x = sqrt(scale) q``, ``y = sqrt(scale) k`` (ARCHITECTURE sec. 3), evaluated in
log space: proposal densities, the target density and the features are log-densities
(magnitudes of order ``|y|^2`` ~ 10^3..10^4 at ViT key norms would overflow otherwise), and
the signed weighting functions of eq. 37-38 carry their sign separately.

Layout (shared with ``batched`` and with :mod:`randattn.theory.montecarlo`):

- ``omega : (R, ..., C, D)``, one sample per proposal, ``omega_c ~ q_c``;
- ``log_proposals : (R, ..., C, C)`` indexed *(proposal c', sample j)*:
  ``log_proposals[..., c', j] = log q_{c'}(omega_j)``;
- ``alpha`` of one sample per proposal: ``(R, ..., N, C)``, ``alpha[..., n, c] = alpha_nc(omega_c)``;
  the full weighting functions at every sample: ``(R, ..., N, C, C)``,
  ``[..., n, c, j] = alpha_nc(omega_j)``, summing to one over ``c`` (axis -2).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.special import log_softmax, logsumexp, softmax

from randattn._callers import outside_stacklevel
from randattn._validation import check_choice
from randattn.estimators._prepare import check_draw_array, prepare_reference
from randattn.estimators.base import Draws, EstimatorOptions, keyword_entry, option
from randattn.estimators.features.reference import positive_log_features
from randattn.estimators.ra.reference import noise_std
from randattn.estimators.snis import warn_non_positive
from randattn.estimators.grid import LAYOUTS, SEQUENCE, TokenLayout, token_layout_of
from randattn.estimators.segments import effective_segments, segment_means
from randattn.estimators.snis.reference import feature_attention

__all__ = [
    "PROPOSALS",
    "WEIGHTINGS",
    "SAMPLES",
    "LaraTerms",
    "check_lara_params",
    "LaraOptions",
    "effective_proposals",
    "landmarks",
    "proposal_means",
    "log_gaussian",
    "log_proposal_densities",
    "query_scores",
    "weighting_functions",
    "log_alpha_at_samples",
    "lara_terms",
    "estimate",
    "log_target_density",
    "log_unnormalized_target",
    "f_values",
    "snis_estimate_eq10",
    "mis_estimate_eq8",
]

#: proposal means (LARA app. G.3.1): eq. 32 mixture, eq. 33, eq. 34 (default), eq. 35, and N(0, I)
PROPOSALS = ("eq34", "eq33", "eq35", "eq32", "standard")
#: weighting functions (LARA app. G.3.2): eq. 36, eq. 37, eq. 38 (default), and 1/C
WEIGHTINGS = ("decoupled", "balance", "coupled", "constant")
SAMPLES = ("random", "mean")
#: sampling noise: the paper's N(0, I), or the official code's N(0, I) in the unscaled space (ARCHITECTURE sec. 10)
NOISES = ("paper", "reference-code")
#: proposals whose means use the key landmarks k~_c (so C_eff <= M as well)
_KEY_LANDMARK_PROPOSALS = ("eq34", "eq35")

_LOG_2PI = float(np.log(2.0 * np.pi))


def check_lara_params(
    proposal: str,
    weighting: str,
    beta: float,
    alpha_clamp: float | None,
    sample: str,
    noise: str,
    layout: str = "grid",
    grid: Any = None,
    prefix_tokens: int = 0,
) -> None:
    """Validate LARA's options in one place; ``ValueError``/``TypeError`` name the argument."""
    check_choice("proposal", proposal, PROPOSALS)
    TokenLayout(layout, grid, prefix_tokens)
    check_choice("weighting", weighting, WEIGHTINGS)
    check_choice("sample", sample, SAMPLES)
    check_choice("noise", noise, NOISES)
    if isinstance(beta, (bool, np.bool_)) or not isinstance(beta, (int, float, np.integer, np.floating)):
        raise TypeError(f"beta must be a real number, got {type(beta).__name__} {beta!r}")
    if not np.isfinite(beta):
        raise ValueError(f"beta must be finite, got {beta!r}")
    if weighting != "decoupled" and beta != 1.0:
        raise ValueError(
            f"beta={beta!r} scales the query-specific correction of weighting='decoupled' (LARA eq. 38) "
            f"only; with weighting={weighting!r} leave it at 1.0"
        )
    if alpha_clamp is not None:
        if isinstance(alpha_clamp, (bool, np.bool_)) or not isinstance(alpha_clamp, (int, float, np.integer, np.floating)):
            raise TypeError(f"alpha_clamp must be None or a positive number, got {type(alpha_clamp).__name__} {alpha_clamp!r}")
        if not (np.isfinite(alpha_clamp) and alpha_clamp > 0):
            raise ValueError(f"alpha_clamp must be None or a finite number > 0, got {alpha_clamp!r}")


@dataclass(frozen=True, kw_only=True)
class LaraOptions(EstimatorOptions):
    """LARA's keyword options, declared once: the spec's ``params`` and every entry point's keywords.

    The entry points (``estimate``, ``lara_terms`` here; ``estimate``, ``probabilities`` and the
    ``estimate_with_*`` forms in :mod:`~randattn.estimators.lara.batched`) are written on one
    ``LaraOptions`` and take its fields as keywords (:func:`~randattn.estimators.base.keyword_entry`);
    construction runs :func:`check_lara_params`, so a bad option raises a ``ValueError``/``TypeError``
    naming the argument before any input is touched. ``grid`` is kept as given (parsed where used).
    """

    proposal: str = option(
        "eq34",
        "proposal means: eq34 x~_c + y~_c (default); eq33 x~_c + sum_m softmax(x~_c.y_m) y_m; "
        "eq35 x~_c + attention over key landmarks; eq32 the RA-like mixture; standard N(0, I)",
        choices=PROPOSALS,
    )
    weighting: str = option(
        "decoupled",
        "weighting functions: decoupled (eq. 38, default), balance heuristic (eq. 36), coupled (eq. 37), constant 1/C",
        choices=WEIGHTINGS,
    )
    beta: float = option(1.0, "coefficient of the decoupled correction (eq. 38; the paper uses 2 for vision)",
                         kind=(int, float))
    alpha_clamp: float | None = option(
        None, "None, or clip weights from below at this value as the official code does (1e-8)",
        kind=(int, float, type(None)),
    )
    sample: str = option("random", "random, or mean: omega_c = E_{q_c}[omega] (LARA G.3.3 eval mode)",
                         choices=SAMPLES)
    noise: str = option(
        "paper",
        "paper: eps ~ N(0, I); reference-code: the official code's N(0, I) in unscaled space = N(0, scale I)",
        choices=NOISES,
    )
    layout: str = option(
        "grid",
        "landmarks from 2-D blocks of the patch grid (grid, LARA app. G.4 '2D average pooling') when the grid "
        "is known, else from contiguous 1-D segments (sequence, app. G.3.1)",
        choices=LAYOUTS,
    )
    grid: Any = option(
        None,
        "patch grid (h, w) or 'HxW' (e.g. 14x14) of the tokens after prefix_tokens; None: no grid known (1-D segments)",
        kind=(tuple, list, str, type(None)),
    )
    prefix_tokens: int = option(
        0, "leading tokens (CLS, registers) before the h*w patches; with a grid they are in no landmark block",
        kind=int,
    )

    def check(self) -> None:
        check_lara_params(self.proposal, self.weighting, self.beta, self.alpha_clamp, self.sample, self.noise,
                          self.layout, self.grid, self.prefix_tokens)

    @property
    def token_layout(self) -> TokenLayout:
        """``layout``, ``grid``, ``prefix_tokens`` as one :class:`~randattn.estimators.grid.TokenLayout`."""
        return TokenLayout(self.layout, self.grid, self.prefix_tokens)

    @property
    def layout_kw(self) -> dict[str, Any]:
        """Deprecated: :attr:`token_layout` (the segment helpers take one ``TokenLayout``)."""
        warnings.warn("LaraOptions.layout_kw is deprecated; use LaraOptions.token_layout", DeprecationWarning,
                      stacklevel=outside_stacklevel())
        return dict(layout=self.layout, grid=self.grid, prefix_tokens=self.prefix_tokens)

    @property
    def signed(self) -> bool:
        """Whether the weights can be negative (:func:`has_signed_weights`)."""
        return has_signed_weights(self.weighting, self.alpha_clamp)


def has_signed_weights(weighting: str, alpha_clamp: float | None) -> bool:
    """Whether LARA's weights can be negative: decoupled or coupled (eq. 38, 37) without ``alpha_clamp``.

    The one home of this fact: the spec's ``signed_weights`` and :class:`LaraOptions` both ask here.
    """
    return weighting in ("decoupled", "coupled") and alpha_clamp is None


def effective_proposals(num_queries: int, num_keys: int, num_proposals: int, proposal: str,
                        token_layout: TokenLayout = SEQUENCE, **legacy: Any) -> int:
    """``C_eff``, the number of proposals (= landmarks = samples) actually used.

    Query landmarks are means of ``C`` query segments, so at most ``N`` of them (``h w``
    with a grid layout, whose segments are blocks of patches); proposals built from key
    landmarks (eq. 34, 35) also need ``C <= M`` (``h w``). The draws always hold ``C`` rows
    and the estimator uses the first ``C_eff``, so one set of draws serves every input length.
    (``layout=, grid=, prefix_tokens=`` in place of ``token_layout`` are deprecated.)
    """
    token_layout = token_layout_of(token_layout, legacy, "effective_proposals")
    token_layout.check_length(num_queries, what="queries")
    limit = effective_segments(num_queries, num_proposals, token_layout)
    if proposal in _KEY_LANDMARK_PROPOSALS:
        token_layout.check_length(num_keys, what="keys")
        limit = min(limit, effective_segments(num_keys, num_proposals, token_layout))
    return limit


def landmarks(x: Any, y: Any, num_c: int, proposal: str, token_layout: TokenLayout = SEQUENCE, *,
              means: Any = segment_means, **legacy: Any) -> tuple[Any, Any]:
    """Query landmarks ``x~ : (..., C, D)`` and key landmarks ``y~`` (None unless eq. 34/35 need them).

    Means of contiguous 1-D segments (app. G.3.1) or of 2-D blocks of the patch grid
    (app. G.4, "2D average pooling (the same as segments)"), see :mod:`randattn.estimators.segments`;
    ``means`` is :func:`~randattn.estimators.segments.segment_means` or its torch form. (``layout=, grid=,
    prefix_tokens=`` in place of ``token_layout`` are deprecated.)
    """
    token_layout = token_layout_of(token_layout, legacy, "landmarks")
    token_layout.check_length(x.shape[-2], what="queries")
    x_lm = means(x, num_c, token_layout)
    if proposal not in _KEY_LANDMARK_PROPOSALS:
        return x_lm, None
    token_layout.check_length(y.shape[-2], what="keys")
    return x_lm, means(y, num_c, token_layout)


def log_gaussian(sq_dist: np.ndarray, dim: int) -> np.ndarray:
    r"""``log N(omega; mu, I)`` from ``|omega - mu|^2``: :math:`-\tfrac12\|\omega-\mu\|^2 - \tfrac D2 \log 2\pi`."""
    return -0.5 * sq_dist - 0.5 * dim * _LOG_2PI


def _component_log_weights(x_lm: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``log pi_cm = log softmax_m(x~_c · y_m)`` : (..., C, M) (eq. 32, 33)."""
    return log_softmax(x_lm @ np.swapaxes(y, -1, -2), axis=-1)


def _sq_dist_to_mixture_means(omega: np.ndarray, centre: np.ndarray, y: np.ndarray) -> np.ndarray:
    r"""``|omega_j - centre_i - y_m|^2`` : (R, ..., I, J, M) for omega (R, ..., J, D), centre (..., I, D), y (..., M, D).

    .. math::
        \|\omega_j - c_i - y_m\|^2 = \|\omega_j - c_i\|^2 - 2\,\omega_j^\top y_m + 2\,c_i^\top y_m + \|y_m\|^2,

    which costs ``O(I J D + (I + J) M D + I J M)`` instead of ``O(I J M D)``.
    """
    d = omega[..., None, :, :] - centre[None, ..., :, None, :]  # (R, ..., I, J, D)
    omega_y = omega @ np.swapaxes(y, -1, -2)[None]  # (R, ..., J, M)
    centre_y = centre @ np.swapaxes(y, -1, -2)  # (..., I, M)
    y_sq = (y * y).sum(-1)  # (..., M)
    return ((d * d).sum(-1)[..., None] - 2.0 * omega_y[..., None, :, :]
            + (2.0 * centre_y + y_sq[..., None, :])[None, ..., :, None, :])


def proposal_means(x_lm: np.ndarray, y_lm: np.ndarray | None, y: np.ndarray, proposal: str) -> np.ndarray:
    r"""Means ``mu_c`` of the proposals ``q_c = N(mu_c, I)`` (LARA app. G.3.1), ``(..., C, D)``.

    .. math::
        \text{eq33: } \mu_c = \tilde x_c + \sum_m \operatorname{softmax}_m(\tilde x_c^\top y_m)\, y_m, \qquad
        \text{eq34: } \mu_c = \tilde x_c + \tilde y_c,

    .. math::
        \text{eq35: } \mu_c = \tilde x_c + \sum_{c'} \operatorname{softmax}_{c'}(\tilde y_c^\top \tilde y_{c'})\,
        \tilde y_{c'}, \qquad \text{standard: } \mu_c = 0.

    For ``eq32`` (a mixture, not a Gaussian) this is the mixture's mean, equal to eq. 33's:
    what ``sample="mean"`` passes as the sample.

    Parameters
    ----------
    x_lm : (..., C, D)
        Query landmarks ``x~_c`` (segment means of ``x``).
    y_lm : (..., C, D) or None
        Key landmarks ``y~_c``; needed by eq. 34 and 35 only.
    y : (..., M, D)
    proposal : {"eq34", "eq33", "eq35", "eq32", "standard"}

    Notes
    -----
    Eq. 35 as printed sums :math:`\tilde k_c` (not :math:`\tilde k_{c'}`) with a normalizer
    over ``c' = 1..M``: its mean would collapse to :math:`\tilde q_c + \tilde k_c` (eq. 34).
    We implement the attention-like aggregation over key landmarks that the text describes
    (and the official code computes), :math:`\sum_{c'} \mathrm{softmax}_{c'} \tilde k_{c'}`.
    """
    if proposal == "standard":
        return np.zeros(x_lm.shape)
    if proposal == "eq34":
        return x_lm + y_lm
    if proposal == "eq35":
        mix = softmax(y_lm @ np.swapaxes(y_lm, -1, -2), axis=-1)  # (..., C, C'): softmax over c'
        return x_lm + mix @ y_lm
    # eq33, and the mixture mean of eq32
    return x_lm + np.exp(_component_log_weights(x_lm, y)) @ y


def log_proposal_densities(
    omega: np.ndarray, x_lm: np.ndarray, y: np.ndarray, mu: np.ndarray, proposal: str
) -> np.ndarray:
    r"""``log q_c'(omega_j)`` for every proposal and sample: ``(R, ..., C, C)`` indexed (c', j).

    Gaussian proposals (eq. 33-35, standard): :math:`\log \mathcal N(\omega_j; \mu_{c'}, I)`.
    The mixture of eq. 32, :math:`q_{c'}(\omega) = \sum_m \pi_{c'm}\, \mathcal N(\omega; \tilde x_{c'} + y_m, I)`,
    is a logsumexp over its M components (``O(C^2 (M + D) + C M D)``), with the squared
    distances of :func:`_sq_dist_to_mixture_means`.

    Parameters
    ----------
    omega : (R, ..., C, D)
    x_lm : (..., C, D)
    y : (..., M, D)
    mu : (..., C, D)
        From :func:`proposal_means`.
    proposal : str

    Notes
    -----
    The densities are always the paper's, with identity covariance, whatever the sampling
    noise (``noise="reference-code"`` changes how omega is drawn, not q_c: that is what the
    official code computes, see :func:`lara_terms`).
    """
    dim = omega.shape[-1]
    if proposal != "eq32":
        diff = omega[..., None, :, :] - mu[None, ..., :, None, :]  # (R, ..., C', J, D)
        return log_gaussian((diff * diff).sum(-1), dim)
    log_pi = _component_log_weights(x_lm, y)  # (..., C', M)
    sq = _sq_dist_to_mixture_means(omega, x_lm, y)  # (R, ..., C', J, M)
    return logsumexp(log_pi[None, ..., :, None, :] + log_gaussian(sq, dim), axis=-1)


def query_scores(x: np.ndarray, x_lm: np.ndarray) -> np.ndarray:
    r"""``r'_nc``, the query-landmark similarity normalized over queries n (LARA eq. 37), ``(..., N, C)``.

    .. math:: r'_{nc} = \frac{\exp(x_n^\top \tilde x_c)}{\sum_{n'=1}^N \exp(x_{n'}^\top \tilde x_c)}.

    Notes
    -----
    Eq. 37 prints the denominator as :math:`\sum_{n=1}^N \exp(q_n^\top \tilde q_{c'})`; we read
    it as a softmax over queries for each proposal (the official code's ``softmax(dim=lq)``),
    so :math:`\sum_n r'_{nc} = 1` and ``r'`` is of order ``1/N``, not ``1/C``.
    """
    return softmax(x @ np.swapaxes(x_lm, -1, -2), axis=-2)


def weighting_functions(log_proposals: np.ndarray, scores: np.ndarray, weighting: str, beta: float = 1.0) -> np.ndarray:
    r"""The weighting functions at every sample: ``(R, ..., N, C, C)``, ``[..., n, c, j] = alpha_nc(omega_j)``.

    Parameters
    ----------
    log_proposals : (R, ..., C, C)
        ``[..., c', j] = log q_c'(omega_j)``.
    scores : (..., N, C)
        ``r'_nc`` from :func:`query_scores` (unused by ``balance`` and ``constant``).
    weighting : {"decoupled", "balance", "coupled", "constant"}
    beta : float
        Coefficient of the decoupled correction.

    Returns
    -------
    (R, ..., N, C, C) ndarray, summing to one over ``c`` (axis -2) for every n and sample.

    Notes
    -----
    With the balance heuristic :math:`b_c(\omega) = q_c(\omega) / \sum_{c'} q_{c'}(\omega)` (eq. 36):

    .. math::
        \text{balance: } \alpha_{nc}(\omega) = b_c(\omega), \qquad
        \text{constant: } \alpha_{nc}(\omega) = 1/C,

    .. math::
        \text{coupled (eq. 37): } \alpha_{nc}(\omega) = b_c(\omega)
            + q_c(\omega)\Big(r'_{nc} - \sum_{c'=1}^C b_{c'}(\omega)\, r'_{nc'}\Big),

    .. math::
        \text{decoupled (eq. 38): } \alpha_{nc}(\omega) = b_c(\omega)
            + \beta\Big(r'_{nc} - \frac1C \sum_{c'=1}^C r'_{nc'}\Big).

    Eq. 37 as printed subtracts :math:`\sum_{c'} \frac{q_c(\omega_c)}{\sum_{c'} q_{c'}(\omega_c)} r'_{nc}`,
    whose summand does not depend on ``c'``; read literally it is :math:`C\, b_c\, r'_{nc}` and the
    weights do not sum to one. The proof below it in app. G.3.2 (and the optimal weights of
    sec. 4.1 / app. D it approximates) needs the ``b``-weighted average of ``r'`` over proposals,
    all densities at the same :math:`\omega`; that is what is implemented. Then
    :math:`\sum_c \alpha_{nc}(\omega) = 1 + \sum_c q_c r'_{nc} - (\sum_c q_c) \sum_{c'} b_{c'} r'_{nc'} = 1`.
    :math:`q_c(\omega)` is a raw density (at most :math:`(2\pi)^{-D/2}`), so this correction is
    tiny unless D is small.
    """
    b = softmax(log_proposals, axis=-2)  # (R, ..., C, J): b_c(omega_j), softmax over proposals c
    num_c = log_proposals.shape[-1]
    shape = (*b.shape[:-2], scores.shape[-2], num_c, num_c)
    if weighting == "constant":
        return np.full(shape, 1.0 / num_c)
    if weighting == "balance":
        return np.broadcast_to(b[..., None, :, :], shape).copy()
    if weighting == "decoupled":
        correction = beta * (scores - scores.mean(-1, keepdims=True))  # (..., N, C)
        return b[..., None, :, :] + correction[None, ..., :, :, None]
    # coupled, eq. 37
    average = scores[None] @ b  # (R, ..., N, J): sum_c' r'_nc' b_c'(omega_j)
    q = np.exp(log_proposals)  # (R, ..., C, J)
    return b[..., None, :, :] + q[..., None, :, :] * (scores[None, ..., :, :, None] - average[..., :, None, :])


def log_alpha_at_samples(
    log_proposals: np.ndarray,
    scores: np.ndarray,
    weighting: str,
    beta: float = 1.0,
    alpha_clamp: float | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    r"""``log|alpha_nc(omega_c)|`` and its sign, the diagonal of :func:`weighting_functions`: ``(R, ..., N, C)``.

    Positive weightings (``balance``, ``constant``, or any weighting with ``alpha_clamp``)
    return ``sign=None``. The balance heuristic is computed in log space,
    :math:`\log b_c(\omega_c) = \log q_c(\omega_c) - \operatorname{logsumexp}_{c'} \log q_{c'}(\omega_c)`,
    so a weight below the smallest float is not rounded to zero.

    ``alpha_clamp`` reproduces the official code, which uses :math:`\log \max(\alpha, \text{clamp})`
    (``clamp = 1e-8`` there): negative decoupled weights become tiny positive ones, and the
    weights no longer sum to one (self-normalization hides this; the estimator is no longer
    the MIS of eq. 8).
    """
    num_c = log_proposals.shape[-1]
    diag = np.diagonal(log_proposals, axis1=-2, axis2=-1)  # (R, ..., C): log q_c(omega_c)
    if weighting in ("balance", "constant"):
        if weighting == "balance":
            log_b = diag - logsumexp(log_proposals, axis=-2)  # (R, ..., C)
        else:
            log_b = np.full(diag.shape, -np.log(num_c))
        log_alpha = np.broadcast_to(log_b[..., None, :], (*log_b.shape[:-1], scores.shape[-2], num_c))
        if alpha_clamp is not None:
            log_alpha = np.maximum(log_alpha, np.log(alpha_clamp))
        return np.array(log_alpha), None
    alpha = np.diagonal(weighting_functions(log_proposals, scores, weighting, beta), axis1=-2, axis2=-1)
    if alpha_clamp is not None:
        return np.log(np.maximum(alpha, alpha_clamp)), None
    with np.errstate(divide="ignore"):  # alpha = 0 exactly is a zero weight: log 0 = -inf
        return np.log(np.abs(alpha)), np.sign(alpha)


@dataclass(frozen=True)
class LaraTerms:
    """Every ingredient of one LARA estimate (paper variables), for the estimator and for checks.

    Attributes
    ----------
    x : (..., N, D)
        ``sqrt(scale) q``.
    y : (..., M, D)
        ``sqrt(scale) k``.
    v : (..., M, Dv)
    omega : (R, ..., C, D)
        One sample per proposal, ``C = C_eff``.
    log_proposals : (R, ..., C, C)
        ``[..., c', j] = log q_c'(omega_j)``.
    log_abs_alpha : (R, ..., N, C)
        ``log|alpha_nc(omega_c)|``.
    alpha_sign : (R, ..., N, C) or None
        ``sign alpha_nc(omega_c)``; None when every weight is positive by construction.
    x_landmarks : (..., C, D) or None
        The query landmarks ``x~_c`` (segment or grid-block means), for checks and theory.
    """

    x: Any
    y: Any
    v: Any
    omega: Any
    log_proposals: Any
    log_abs_alpha: Any
    alpha_sign: Any
    x_landmarks: Any = None


def _num_proposals(draws: Draws, batch: tuple[int, ...], dim: int, sample: str) -> int:
    """C as drawn: the rows of ``eps`` (random) or of the zero-size ``proposal_slots`` (mean)."""
    if sample == "mean":
        return check_draw_array(draws, "proposal_slots", batch, (None, 0)).shape[-2]
    return check_draw_array(draws, "eps", batch, (None, dim)).shape[-2]


@keyword_entry(LaraOptions)
def lara_terms(q: Any, k: Any, v: Any, draws: Draws, options: LaraOptions) -> LaraTerms:
    r"""Landmarks, proposals, samples and weighting functions of LARA (app. G.3), as :class:`LaraTerms`.

    Steps (Algorithm 3): query landmarks :math:`\tilde x_c` = means of ``C_eff`` contiguous
    segments of ``x``, or of ``C_eff`` blocks of its patch grid (``layout="grid"`` with a
    ``grid``, app. G.4; :mod:`randattn.estimators.segments`; key landmarks likewise from ``y``);
    proposal means :math:`\mu_c` (:func:`proposal_means`); samples
    :math:`\omega_c = \mu_c + \sigma \epsilon_c` (for eq. 32:
    :math:`\omega_c = \tilde x_c + y_{z_c} + \sigma\epsilon_c`, :math:`z_c = \#\{m : F_{cm} < u_c\}`
    with :math:`F_c` the CDF of :math:`\pi_c`), or :math:`\omega_c = \mu_c` for ``sample="mean"``;
    the densities :math:`\log q_{c'}(\omega_j)`, the scores :math:`r'_{nc}` and the weights
    :math:`\alpha_{nc}(\omega_c)`.

    ``sigma`` is 1 (``noise="paper"``) or ``sqrt(scale)`` (``"reference-code"``: the official
    code's unit noise in the unscaled space, ARCHITECTURE sec. 10); the densities keep the
    paper's identity covariance either way, as the official code's do.
    """
    x, y, v, scale, batch = prepare_reference(q, k, v, options.scale)
    sigma = noise_std(options.noise, scale)
    num_q, num_k, dim = x.shape[-2], y.shape[-2], x.shape[-1]
    drawn = _num_proposals(draws, batch, dim, options.sample)
    token_layout = options.token_layout
    num_c = effective_proposals(num_q, num_k, drawn, options.proposal, token_layout)
    x_lm, y_lm = landmarks(x, y, num_c, options.proposal, token_layout)  # (..., C, D)
    mu = proposal_means(x_lm, y_lm, y, options.proposal)
    if options.sample == "mean":
        omega = np.broadcast_to(mu, (draws.replicates, *mu.shape)).copy()
    else:
        eps = draws["eps"][..., :num_c, :]
        if options.proposal == "eq32":
            u = check_draw_array(draws, "u", batch, (drawn,))[..., :num_c]
            cdf = np.cumsum(np.exp(_component_log_weights(x_lm, y)), axis=-1)  # (..., C, M)
            z = (cdf[None] < u[..., None]).sum(-1)  # (R, ..., C): inverse CDF, as in ra.reference
            z = np.minimum(z, num_k - 1)  # u above a rounded-down total mass
            y_b = np.broadcast_to(y, (draws.replicates, *y.shape))
            picked = np.take_along_axis(y_b, z[..., None], axis=-2)  # (R, ..., C, D)
            omega = x_lm[None] + picked + sigma * eps
        else:
            omega = mu[None] + sigma * eps
    log_q = log_proposal_densities(omega, x_lm, y, mu, options.proposal)
    scores = query_scores(x, x_lm)
    log_abs_alpha, alpha_sign = log_alpha_at_samples(log_q, scores, options.weighting, options.beta, options.alpha_clamp)
    return LaraTerms(x, y, v, omega, log_q, log_abs_alpha, alpha_sign, x_lm)


def _warn_non_positive(sign: Any) -> None:
    warn_non_positive(
        sign,
        "negative weighting functions, LARA eq. 37-38; alpha_clamp reproduces the official code's clipping",
    )


@keyword_entry(LaraOptions)
def estimate(q: Any, k: Any, v: Any, draws: Draws, options: LaraOptions) -> np.ndarray:
    r"""Linear randomized attention (LARA eq. 10 in the form of eq. 28), linear in N and M.

    .. math::
        \mathrm{LARA}(q_n) = \frac{\sum_{c=1}^C \alpha'_{nc}(\omega_c)\, \xi(x_n, \omega_c)
                \sum_m \xi(y_m, \omega_c)\, v_m}
            {\sum_{c=1}^C \alpha'_{nc}(\omega_c)\, \xi(x_n, \omega_c) \sum_m \xi(y_m, \omega_c)},
        \qquad \alpha'_{nc}(\omega) = \alpha_{nc}(\omega) \frac{\mathcal N(\omega; 0, I)}{q_c(\omega)},

    with :math:`\omega_c \sim q_c` (one sample per proposal) and
    :math:`\xi(x, \omega) = \exp(\omega^\top x - \|x\|^2/2)`. This is the self-normalized
    multiple importance sampler (eq. 10) of :math:`\mathbb E_{p_n}[f_n]` = softmax attention
    (Prop. 3.2); see :func:`snis_estimate_eq10` for the literal eq. 10.

    Parameters
    ----------
    q, k, v : array_like
        Queries (..., N, D), keys (..., M, D), values (..., M, Dv).
    draws : Draws
        From :func:`randattn.estimators.lara.draw`: ``eps : (R, ..., C, D)``, plus
        ``u : (R, ..., C)`` for ``proposal="eq32"``; for ``sample="mean"`` only the zero-size
        ``proposal_slots : (R, ..., C, 0)`` whose shape carries ``C``. The first
        ``C_eff = min(C, N)`` rows are used (``min(C, N, M)`` for eq. 34, 35).
    scale, proposal, weighting, beta, alpha_clamp, sample, noise, layout, grid, prefix_tokens
        Keywords: the temperature (default ``D ** -0.5``) and LARA's options, whose meanings, choices and
        defaults are those of :class:`LaraOptions` (the landmark layouts: :mod:`randattn.estimators.segments`).

    Returns
    -------
    (R, ..., N, Dv)

    Notes
    -----
    Runs through the log-space SNIS skeleton (:func:`randattn.estimators.snis.reference.feature_attention`)
    with sample axis C: query log-features :math:`\log\xi(x_n, \omega_c) + \log|\alpha'_{nc}|`,
    query signs :math:`\operatorname{sign}\alpha_{nc}`. Cost
    :math:`O((N + M) C (D + D_v) + C^2 D)`, plus :math:`O(N C^2)` for ``coupled``,
    :math:`O(C M D)` for eq. 33 and :math:`O(C^2 M D)` for the eq. 32 mixture density; never
    an ``N x M`` matrix, no epsilon. A zero or negative normalizer (signed weights) emits
    :class:`~randattn.estimators.snis.NonPositiveDenominatorWarning`.

    References
    ----------
    Zheng, Wang, Kong, "Linear Complexity Randomized Self-attention Mechanism", ICML 2022:
    eq. 8-10, 28 (app. E), 32-38 (app. G.3), Algorithm 3.

    Examples
    --------
    >>> import numpy as np
    >>> from randattn.estimators import lara
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.normal(size=(3, 16, 8))
    >>> draws = lara.draw(q.shape, k.shape, num_samples=4, rng=np.random.default_rng(1))
    >>> lara.reference.estimate(q, k, v, draws).shape
    (1, 16, 8)
    """
    terms = lara_terms.on_options(q, k, v, draws, options)
    log_qf, log_kf, q_sign = weighted_log_features(terms)
    out, sign = feature_attention(log_qf, log_kf, terms.v[None], q_sign=q_sign)
    if q_sign is not None:
        _warn_non_positive(sign)
    return out


def weighted_log_features(terms: LaraTerms) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    r"""The SNIS log-features of LARA's eq. 28 form.

    Returns ``(log_qf, log_kf, q_sign)`` with ``log_qf = log|alpha'_nc| + log xi(x_n, omega_c)``
    ``(R, ..., N, C, 1)``, ``log_kf = log xi(y_m, omega_c)`` ``(R, ..., M, C, 1)`` and the sign of
    :math:`\alpha'_{nc}` (None when every weight is positive by construction), where
    :math:`\alpha'_{nc} = \alpha_{nc}(\omega_c)\, \mathcal N(\omega_c; 0, I) / q_c(\omega_c)`.
    """
    omega, x, y = terms.omega, terms.x, terms.y
    log_std_normal = log_gaussian((omega * omega).sum(-1), x.shape[-1])  # (R, ..., C)
    log_q_own = np.diagonal(terms.log_proposals, axis1=-2, axis2=-1)
    log_alpha_prime = terms.log_abs_alpha + (log_std_normal - log_q_own)[..., None, :]  # (R, ..., N, C)
    log_qf, _ = positive_log_features(x[None], omega)  # (R, ..., N, C, 1)
    log_kf, _ = positive_log_features(y[None], omega)  # (R, ..., M, C, 1)
    q_sign = None if terms.alpha_sign is None else terms.alpha_sign[..., None]
    return log_qf + log_alpha_prime[..., None], log_kf, q_sign


# ----------------------------------------------------------------------------------------
# quadratic literal forms, for identities and unbiasedness checks
# ----------------------------------------------------------------------------------------


def log_target_density(x: np.ndarray, y: np.ndarray, omega: np.ndarray) -> np.ndarray:
    r"""``log p_n(omega_c)`` of the RA mixture (LARA eq. 5 / 29), quadratic: ``(R, ..., N, C)``.

    .. math::
        p_n(\omega) = \sum_{m=1}^M \pi_{nm}\, \mathcal N(\omega; x_n + y_m, I), \qquad
        \pi_{nm} = \operatorname{softmax}_m(x_n^\top y_m).

    Parameters
    ----------
    x : (..., N, D)
    y : (..., M, D)
    omega : (R, ..., C, D)
    """
    dim = x.shape[-1]
    log_pi = log_softmax(x @ np.swapaxes(y, -1, -2), axis=-1)  # (..., N, M)
    sq = _sq_dist_to_mixture_means(omega, x, y)  # (R, ..., N, C, M): |omega_c - x_n - y_m|^2
    return logsumexp(log_pi[None, ..., :, None, :] + log_gaussian(sq, dim), axis=-1)


def log_unnormalized_target(x: np.ndarray, y: np.ndarray, omega: np.ndarray) -> np.ndarray:
    r"""``log p~_n(omega_c)`` (LARA sec. 4.2, app. E), ``(R, ..., N, C)``.

    .. math::
        \tilde p_n(\omega) = \mathcal N(\omega; 0, I)\, \xi(x_n, \omega)^\top \sum_{m=1}^M \xi(y_m, \omega)
        = p_n(\omega) \sum_m \exp(x_n^\top y_m).
    """
    lx, _ = positive_log_features(x[None], omega)  # (R, ..., N, C, 1)
    ly, _ = positive_log_features(y[None], omega)  # (R, ..., M, C, 1)
    log_std_normal = log_gaussian((omega * omega).sum(-1), omega.shape[-1])  # (R, ..., C)
    return log_std_normal[..., None, :] + lx[..., 0] + logsumexp(ly[..., 0], axis=-2)[..., None, :]


def f_values(x: np.ndarray, y: np.ndarray, v: np.ndarray, omega: np.ndarray) -> np.ndarray:
    r"""``f_n(omega_c)`` of LARA eq. 6, quadratic: ``(R, ..., N, C, Dv)``.

    .. math::
        f_n(\omega) = \frac{\sum_m \xi(x_n, \omega)\, \xi(y_m, \omega)\, v_m}
                           {\sum_{m'} \xi(x_n, \omega)\, \xi(y_{m'}, \omega)}

    computed as a softmax over keys of :math:`\log\xi(x_n,\omega) + \log\xi(y_m,\omega)`
    (the query feature is kept, as printed; it cancels).
    """
    lx, _ = positive_log_features(x[None], omega)  # (R, ..., N, C, 1)
    ly, _ = positive_log_features(y[None], omega)  # (R, ..., M, C, 1)
    logits = lx[..., :, :, None, 0] + np.swapaxes(ly[..., 0], -1, -2)[..., None, :, :]  # (R, ..., N, C, M)
    return softmax(logits, axis=-1) @ v[None, ..., None, :, :]


def _signed_weighted_sum(log_abs: np.ndarray, sign: np.ndarray | None, f: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``sum_c sign_c exp(log_abs_c) f_c`` as (scaled sum, scaled weight sum, log scale), over axis -1 of log_abs."""
    shift = log_abs.max(axis=-1, keepdims=True)
    shift = np.where(np.isfinite(shift), shift, 0.0)
    w = np.exp(log_abs - shift)
    if sign is not None:
        w = w * sign
    return (w[..., None, :] @ f)[..., 0, :], w.sum(-1), shift[..., 0]


def snis_estimate_eq10(terms: LaraTerms) -> np.ndarray:
    r"""The literal self-normalized MIS of LARA eq. 10 (quadratic in N, M), ``(R, ..., N, Dv)``.

    .. math::
        \mathrm{LARA}(q_n) = \frac{\sum_c \alpha_{nc}(\omega_c) \frac{\tilde p_n(\omega_c)}{q_c(\omega_c)} f_n(\omega_c)}
                                  {\sum_c \alpha_{nc}(\omega_c) \frac{\tilde p_n(\omega_c)}{q_c(\omega_c)}},

    with :math:`\tilde p_n` from :func:`log_unnormalized_target` and :math:`f_n` from
    :func:`f_values`; the weights are formed in signed log space. Equals :func:`estimate`
    (the eq. 28 form, app. E) with the same terms.
    """
    log_w = terms.log_abs_alpha + log_unnormalized_target(terms.x, terms.y, terms.omega) \
        - np.diagonal(terms.log_proposals, axis1=-2, axis2=-1)[..., None, :]
    f = f_values(terms.x, terms.y, terms.v, terms.omega)  # (R, ..., N, C, Dv)
    num, den, _ = _signed_weighted_sum(log_w, terms.alpha_sign, f)
    return num / den[..., None]


def mis_estimate_eq8(terms: LaraTerms) -> np.ndarray:
    r"""The (non-self-normalized) multiple importance sampler of LARA eq. 8, quadratic: ``(R, ..., N, Dv)``.

    .. math::
        \hat g_n = \sum_{c=1}^C \alpha_{nc}(\omega_c) \frac{p_n(\omega_c)}{q_c(\omega_c)} f_n(\omega_c),
        \qquad \omega_c \sim q_c,

    with the exact RA mixture density :math:`p_n` (:func:`log_target_density`). Unbiased for
    softmax attention when :math:`\sum_c \alpha_{nc}(\omega) = 1` for all :math:`\omega` (app. F).
    With ``C = N`` proposals :math:`q_c = p_c` and :math:`\alpha_{nc} = \delta_{nc}` it is RA
    with one sample (sec. 4.3).

    Notes
    -----
    Only the weights' logs are shifted for the products; the sum itself is restored to its
    scale, which overflows when :math:`p_n / q_c` does (then use :func:`snis_estimate_eq10`).
    """
    log_w = terms.log_abs_alpha + log_target_density(terms.x, terms.y, terms.omega) \
        - np.diagonal(terms.log_proposals, axis1=-2, axis2=-1)[..., None, :]
    f = f_values(terms.x, terms.y, terms.v, terms.omega)
    num, _, shift = _signed_weighted_sum(log_w, terms.alpha_sign, f)
    return num * np.exp(shift)[..., None]
