r"""EVA, efficient attention via control variates, in numpy float64 (reference form).

Loops over chunk groups, chunks and local blocks; numpy over replicates and batch dims.
Everything is in the paper's variables ``x = sqrt(scale) q``, ``y = sqrt(scale) k``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.special import logsumexp, softmax

from randattn._validation import check_choice, check_positive_int
from randattn.estimators._prepare import check_draw_array, prepare_reference
from randattn.estimators.base import Draws, keyword_entry, option
from randattn.estimators.eva.partition import (
    PARTITIONS,
    LayoutOptions,
    check_layout_params,
    check_mask_layout,
    eva_partition,
)
from randattn.estimators.features.reference import positive_log_features
from randattn.estimators.grid import resolve_grid, window_side
from randattn.estimators.ra.reference import noise_std
from randattn.estimators.snis.reference import feature_attention

__all__ = [
    "estimate",
    "check_eva_params",
    "EvaOptions",
    "chunk_noise",
    "CHUNK_WEIGHTS",
    "PROPOSAL_MEANS",
    "SAMPLES",
    "NOISES",
    "log_proposal_ratio",
    "chunk_proposal_mean",
]

#: ``exact``: eq. 13 (quadratic); ``mean-key``: eq. 16 with mean-pooled keys; ``rfa``: the RFA estimate of the chunk's mass
CHUNK_WEIGHTS = ("exact", "mean-key", "rfa")
#: ``sum``: mu_c = q~_c + k~_c (eq. 28); ``half``: 0.5 (q~_c + k~_c) (official code); ``standard``: mu_c = 0
PROPOSAL_MEANS = ("sum", "half", "standard")
SAMPLES = ("random", "mean")
NOISES = ("paper", "reference-code")


def check_eva_params(
    *,
    window: int,
    prefix_tokens: int,
    partition: str,
    layout: str = "grid",
    grid: Any = None,
    chunk_weight: str,
    add_log_chunk_size: bool,
    proposal_mean: str,
    sample: str,
    noise: str,
    samples_per_chunk: int,
    mask: str | None = None,
) -> None:
    """Validate EVA's options in one place (ValueError/TypeError naming the argument and the allowed values).

    ``mask="causal"`` is refused with a grid (a 2-D window has no causal meaning) and with
    ``partition="reference-code"`` (:func:`~randattn.estimators.eva.partition.check_mask_layout`).
    """
    window, _ = check_layout_params(window, prefix_tokens)
    if resolve_grid(layout, grid) is not None and window > 0:
        window_side(window)
    check_choice("partition", partition, PARTITIONS)
    check_mask_layout(mask, grid=resolve_grid(layout, grid), partition=partition)
    check_choice("chunk_weight", chunk_weight, CHUNK_WEIGHTS)
    check_choice("proposal_mean", proposal_mean, PROPOSAL_MEANS)
    check_choice("sample", sample, SAMPLES)
    check_choice("noise", noise, NOISES)
    check_positive_int("samples_per_chunk", samples_per_chunk)
    if not isinstance(add_log_chunk_size, (bool, np.bool_)):
        raise TypeError(f"add_log_chunk_size must be bool, got {type(add_log_chunk_size).__name__} {add_log_chunk_size!r}")


@dataclass(frozen=True, kw_only=True)
class EvaOptions(LayoutOptions):
    """EVA's keyword options, declared once: the layout options, EVA's own, then ``mask``.

    Construction runs :func:`check_eva_params`, so a bad option raises before any input is touched.
    """

    partition: str = option(
        "paper", "paper: chunks of the keys outside E^n; reference-code: chunks of all keys (window counted twice)",
        choices=PARTITIONS,
    )
    chunk_weight: str = option(
        "exact",
        "exact: sum_{P_c} exp(x.y) (eq. 13, quadratic); mean-key: exp(x.mean_c y) (eq. 16); rfa: its random-feature estimate",
        choices=CHUNK_WEIGHTS,
    )
    add_log_chunk_size: bool = option(False, "mean-key only: multiply the chunk weight by |P_c|", kind=bool)
    proposal_mean: str = option(
        "sum", "mu_c = q~_c + k~_c (eq. 28), half of it (official code), or standard: 0", choices=PROPOSAL_MEANS
    )
    sample: str = option(
        "random", "random, or mean: omega_c = mu_c (Algorithm 1's inference mode, deterministic)", choices=SAMPLES
    )
    noise: str = option(
        "paper", "paper: sigma = 1; reference-code: the official N(0, I) in unscaled space = sigma sqrt(scale)",
        choices=NOISES,
    )
    samples_per_chunk: int = option(
        1, "S_c samples per chunk (app. C 'multiple samples'; >1 makes beta_c query-dependent)", kind=int
    )
    mask: str | None = None

    def check(self) -> None:
        check_eva_params(
            window=self.window, prefix_tokens=self.prefix_tokens, layout=self.layout, grid=self.grid,
            partition=self.partition, chunk_weight=self.chunk_weight, add_log_chunk_size=self.add_log_chunk_size,
            proposal_mean=self.proposal_mean, sample=self.sample, noise=self.noise,
            samples_per_chunk=self.samples_per_chunk, mask=self.mask,
        )


def chunk_proposal_mean(kind: str, q_landmark: Any, k_landmark: Any) -> Any:
    r"""The proposal mean :math:`\mu_c` (EVA eq. 28) from the chunk landmarks (numpy or torch).

    ``sum``: :math:`\tilde q_c + \tilde k_c`; ``half``: :math:`(\tilde q_c + \tilde k_c)/2`
    (official code); ``standard``: 0, i.e. the RFA proposal N(0, I).
    """
    if kind == "sum":
        return q_landmark + k_landmark
    if kind == "half":
        return 0.5 * (q_landmark + k_landmark)
    return 0.0 * (q_landmark + k_landmark)


def log_proposal_ratio(omega: Any, mu: Any, sigma: float) -> Any:
    r""":math:`\log \mathcal N(\omega; 0, I) - \log \mathcal N(\omega; \mu, \sigma^2 I)` over the last axis.

    .. math:: -\tfrac12\|\omega\|^2 + \tfrac{1}{2\sigma^2}\|\omega - \mu\|^2 + D \log\sigma.

    The log importance weight :math:`\log \alpha(\omega)` of EVA app. C without the query-
    and sample-count constants (:math:`-\log Z - \log S`), which cancel in every ratio here.
    Works on numpy arrays and torch tensors.
    """
    dim = omega.shape[-1]
    diff = omega - mu
    return -0.5 * (omega * omega).sum(-1) + 0.5 * (diff * diff).sum(-1) / sigma**2 + dim * float(np.log(sigma))


def chunk_noise(draws: Draws, batch: tuple[int, ...], dim: int, options: EvaOptions) -> tuple[Any, int]:
    """``eps : (R, ..., C, S_c, D)`` (``S_c = 0`` for ``sample="mean"``) and the requested C (numpy or torch draws)."""
    per_chunk = options.samples_per_chunk if options.sample == "random" else 0
    eps = check_draw_array(draws, "eps", batch, (None, per_chunk, dim))
    num_chunks = eps.shape[-3]
    if num_chunks < 1:
        raise ValueError(f"draws['eps'] has C = {num_chunks} chunks; EVA needs num_samples = C >= 1")
    return eps, num_chunks


@keyword_entry(EvaOptions)
def estimate(q: Any, k: Any, v: Any, draws: Draws, options: EvaOptions) -> np.ndarray:
    r"""EVA (EVA sec. 4, eq. 13 / 16, app. C; causal: app. D, Algorithm 2), computed in log space.

    For query :math:`n` with exact set :math:`E^n` and chunks :math:`P^n_1..P^n_C`
    (:mod:`randattn.estimators.eva.partition`),

    .. math::
        \mathrm{EVA}(x_n) = \frac{\sum_{m \in E^n} e^{x_n^\top y_m} v_m + \sum_c W_{nc}\, \hat\beta_{nc}}
                                 {\sum_{m \in E^n} e^{x_n^\top y_m} + \sum_c W_{nc}},

    evaluated as a softmax over the union of the :math:`|E^n|` logits :math:`x_n^\top y_m` and
    the :math:`C` chunk log-weights :math:`\log W_{nc}`. The control coefficient of chunk c
    (app. C, "multiple samples") from :math:`S_c` samples
    :math:`\omega_{cs} = \mu_c + \sigma \epsilon_{cs} \sim q_c = \mathcal N(\mu_c, \sigma^2 I)` is

    .. math::
        \hat\beta_{nc} = \frac{\sum_s \alpha(\omega_{cs}) \xi(x_n, \omega_{cs}) \sum_{m \in P_c} \xi(y_m, \omega_{cs}) v_m}
                              {\sum_s \alpha(\omega_{cs}) \xi(x_n, \omega_{cs}) \sum_{m \in P_c} \xi(y_m, \omega_{cs})},
        \qquad \alpha(\omega) = \frac{\mathcal N(\omega; 0, I)}{q_c(\omega)},

    which for :math:`S_c = 1` is the query-independent :math:`\mathrm{softmax}_{m \in P_c}(\omega_c^\top y_m - \|y_m\|^2/2)`
    average of the chunk's values (Algorithm 1). The chunk weight is

    - ``exact``: :math:`W_{nc} = \sum_{m \in P_c} e^{x_n^\top y_m}` (eq. 13; quadratic, isolates
      the control-variate error);
    - ``mean-key``: :math:`W_{nc} = e^{x_n^\top \tilde y_c}` with :math:`\tilde y_c` the mean of the
      chunk's keys (eq. 16, 26 with the identity for the trained projection), times
      :math:`|P_c|` when ``add_log_chunk_size``;
    - ``rfa``: :math:`W_{nc} = \frac1{S_c}\sum_s \alpha(\omega_{cs}) \xi(x_n, \omega_{cs}) \sum_{m \in P_c} \xi(y_m, \omega_{cs})`,
      the importance-sampling estimate of :math:`\sum_{m \in P_c} e^{x_n^\top y_m}` from the same
      samples (with C = 1 and :math:`\mu = 0` this is Scatterbrain, app. G.5).

    Parameters
    ----------
    q, k, v : array_like
        Queries (..., N, D), keys (..., M, D), values (..., M, Dv).
    draws : Draws
        ``eps : (R, ..., C, S_c, D)`` from :func:`randattn.estimators.eva.draw`, standard
        normal and shared by every query block (common random numbers); ``S_c = 0`` for
        ``sample="mean"`` (then only its chunk count C is used).
    scale : float, optional
        Temperature; default ``D ** -0.5``.
    window : int
        W >= 0, local block size in tokens (default 49; clipped to the sequence). With a grid
        (``layout="grid"``) the blocks are s x s windows of the patch grid and ``W = s^2``
        must be a perfect square (49 = 7x7, EVA's DeiT window, sec. 5.1 / app. E).
    prefix_tokens : int
        Keys exact for every query (1 for a ViT's CLS token); the prefix queries' exact set is
        the prefix keys alone.
    layout : {"grid", "sequence"}
        ``grid``: 2-D windows and 2-D chunks on ``grid`` (when one is given; EVA app. C "2D
        windows for images"); ``sequence``: 1-D contiguous blocks and chunks.
    grid : (h, w), "HxW" or None
        The patch grid of the body tokens (``N = M = prefix_tokens + h w``, raster order).
        None: no grid known, 1-D behaviour. See :mod:`randattn.estimators.eva.partition`.
    partition : {"paper", "reference-code"}
        Chunks of :math:`[M] \setminus E^n` (paper) or of all non-prefix keys (official code).
    chunk_weight : {"exact", "mean-key", "rfa"}
    add_log_chunk_size : bool
        ``mean-key`` only: multiply the weight by :math:`|P_c|`.
    proposal_mean : {"sum", "half", "standard"}
        :math:`\mu_c = \tilde x_c + \tilde y_c` (eq. 28), half of it (official code), or 0.
    sample : {"random", "mean"}
        ``mean``: :math:`\omega_c = \mu_c`, one deterministic sample per chunk (Algorithm 1's
        inference mode); ``samples_per_chunk`` copies of it would give the same value.
    noise : {"paper", "reference-code"}
        :math:`\sigma = 1`, or the official code's :math:`\sigma = \sqrt{\mathrm{scale}}`
        (:func:`randattn.estimators.ra.reference.noise_std`).
    samples_per_chunk : int
        :math:`S_c`; must match the draws.
    mask : {None, "causal"}
        ``"causal"``: key m visible to query n iff ``m <= n + M - N`` (needs M >= N). The exact
        set is the visible part of the block of key ``n + M - N`` (Algorithm 2's ``K x K``
        triangle) and the chunks split the keys before that block, so each lies wholly before
        :math:`E^n` (:mod:`randattn.estimators.eva.partition`). ValueError with a grid layout
        or ``partition="reference-code"``. The draws are those of the bidirectional form.

    Returns
    -------
    (R, ..., N, Dv)

    Notes
    -----
    Cost: ``O(N |E| (D + Dv))`` for the exact part; per chunk group ``O(M S_c D)`` for the
    coefficients (one group per local block for the paper's partition, which re-chunks each
    block's complement; one group for ``reference-code``); ``O(N C S_c (D + Dv))`` for the
    combination; ``chunk_weight="exact"`` adds ``O(N M D)``. Everything is a log-sum-exp or a
    softmax, so no exponential overflows (key norms of 150 are fine) and no epsilon is added.
    The output is a convex combination of values and of chunk coefficients, themselves convex
    combinations of values.

    References
    ----------
    EVA (Zheng et al., ICLR 2023) sec. 4.1 eq. 11-13, sec. 4.2 eq. 16, app. C eq. 26-28,
    Algorithm 1; app. G.1 (special cases).

    Examples
    --------
    >>> import numpy as np
    >>> from randattn.estimators import eva
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.normal(size=(3, 2, 16, 8))
    >>> draws = eva.draw(q.shape, k.shape, num_samples=4, replicates=5, rng=rng)
    >>> eva.reference.estimate(q, k, v, draws, window=4).shape
    (5, 2, 16, 8)
    """
    x, y, v, scale, batch = prepare_reference(q, k, v, options.scale)
    sigma = noise_std(options.noise, scale)
    num_q, num_k, dim = x.shape[-2], y.shape[-2], x.shape[-1]
    eps, num_chunks = chunk_noise(draws, batch, dim, options)
    reps = draws.replicates
    parts = eva_partition(
        num_q, num_k, window=options.window, prefix_tokens=options.prefix_tokens, num_chunks=num_chunks,
        partition=options.partition, grid=options.resolved_grid, mask=options.mask,
    )
    last = parts.last_visible  # (N,) t_n under the causal mask, else None

    c_max = parts.max_chunks
    lead = (reps, *batch)
    chunk_logw = np.full((*lead, num_q, c_max), -np.inf)  # log W_nc; -inf = no such chunk
    chunk_beta = np.zeros((*lead, num_q, c_max, v.shape[-1]))  # beta_nc
    for group in parts.groups:
        qi = group.queries
        x_g = x[..., qi, :]  # (..., n_g, D)
        for c, (keys, sources) in enumerate(zip(group.chunks, group.chunk_queries)):
            y_c, v_c = y[..., keys, :], v[..., keys, :]
            k_land = y_c.mean(-2)  # (..., D)
            q_land = x[..., sources, :].mean(-2)
            mu = chunk_proposal_mean(options.proposal_mean, q_land, k_land)[None, ..., None, :]  # (1, ..., 1, D)
            if options.sample == "random":
                omega = mu + sigma * eps[..., c, :, :]  # (R, ..., S_c, D)
            else:
                omega = np.broadcast_to(mu, (*lead, 1, dim))
            log_alpha = log_proposal_ratio(omega, mu, sigma)  # (R, ..., S_c)
            log_qf = positive_log_features(x_g[None], omega)[0][..., 0] + log_alpha[..., None, :]  # (R, ..., n_g, S_c)
            log_kf = positive_log_features(y_c[None], omega)[0][..., 0]  # (R, ..., |P_c|, S_c)
            beta, _ = feature_attention(log_qf[..., None], log_kf[..., None], v_c[None])  # (R, ..., n_g, Dv)
            if options.chunk_weight == "exact":
                logw = logsumexp(x_g @ np.swapaxes(y_c, -1, -2), axis=-1)[None]  # (1, ..., n_g)
            elif options.chunk_weight == "mean-key":
                logw = (x_g @ k_land[..., :, None])[None, ..., 0]
                if options.add_log_chunk_size:
                    logw = logw + np.log(len(keys))
            else:  # rfa: log (1/S) sum_s alpha xi(x, w_s) sum_m xi(y_m, w_s)
                log_mass = logsumexp(log_kf, axis=-2)  # (R, ..., S_c)
                logw = logsumexp(log_qf + log_mass[..., None, :], axis=-1) - np.log(omega.shape[-2])
            chunk_logw[..., qi, c] = logw
            chunk_beta[..., qi, c, :] = beta

    out = np.empty((*lead, num_q, v.shape[-1]))
    for qi, exact in parts.blocks():
        e_logits = x[..., qi, :] @ np.swapaxes(y[..., exact, :], -1, -2)  # (..., n_b, |E|)
        if last is not None:  # Algorithm 2's M^E: the block's keys after t_n are hidden (every chunk is visible)
            e_logits = np.where(exact[None, :] <= last[qi][:, None], e_logits, -np.inf)
        e_logits = np.broadcast_to(e_logits[None], (*lead, len(qi), len(exact)))
        logits = np.concatenate([e_logits, chunk_logw[..., qi, :]], axis=-1)  # (R, ..., n_b, |E| + C)
        p = softmax(logits, axis=-1)
        out[..., qi, :] = p[..., : len(exact)] @ v[None, ..., exact, :] + (p[..., len(exact):, None] * chunk_beta[..., qi, :, :]).sum(-2)
    return out

