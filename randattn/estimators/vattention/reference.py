r"""vAttention in numpy float64 (the reference form): one query at a time, literally.

For query :math:`n` (logits :math:`s_m = x_n^\top y_m`, visible keys :math:`V_n`):

1. **Heavy set** :math:`I_f = I_s \cup I_l \cup I_t`, computed exactly: the visible keys among the first
   ``sinks`` keys :math:`I_s` (none once a sliding window has passed them), the ``local`` keys ending at the
   query's own position :math:`I_l`, and the ``top_k`` keys of largest logit among the other visible keys
   :math:`I_t` (ties: the lower key index first, among equal computed logits, as in :mod:`randattn.estimators.topk`).
2. **Residual** :math:`I_r = V_n \setminus I_f`, of size :math:`n_s` (``sample_from="window"``: the keys between
   the sinks and the local window instead, top-k keys included, as the official code).
3. **Sample size** :math:`b`: ``S`` (``budget="fixed"``), or the CLT budget (``budget="adaptive"``,
   :func:`sample_size`).
4. **Sample** :math:`j_1, \dots, j_b` uniformly from :math:`I_r`, with replacement:
   :math:`j_i = I_r[\lfloor u_i n_s \rfloor]` for the draws' uniforms :math:`u_i` (:math:`I_r` in ascending key
   order).
5. **Estimate**

   .. math::
       \hat N = \sum_{m \in I_f} e^{s_m} v_m + \frac{n_s}{b} \sum_{i=1}^{b} e^{s_{j_i}} v_{j_i}, \qquad
       \hat D = \sum_{m \in I_f} e^{s_m} + \frac{n_s}{b} \sum_{i=1}^{b} e^{s_{j_i}}, \qquad
       \hat y_n = \hat N / \hat D,

   i.e. weights :math:`w_m = 1` on :math:`I_f` and :math:`w_m = c_m n_s / b` on a key drawn :math:`c_m` times
   (``duplicates="merge"``: :math:`n_s / b` whatever :math:`c_m \ge 1`, the official code), formed in log space
   by :func:`randattn.estimators.sparse.reference.weighted_attention`. Since :math:`E[c_m] = b / n_s`, both
   residual sums are unbiased; :math:`\hat y_n` is their ratio (consistent, bias :math:`O(1/b)`).

The other forms follow from the same weights (:class:`~randattn.estimators.sparse.forms.WeightedKeysForms`):
``probabilities`` :math:`w_m e^{s_m} / \hat D`; ``keys_used``, the heavy set plus the distinct sampled keys (the
base sample's keys are not counted: their logits size the sample but their values never enter the estimate, like
the top-k scoring, which reads every key's logit); ``log_denominator``, :math:`\log \hat D` as a logsumexp of
:math:`\log w + s` (finite for logits of any size: the heavy set is never empty), which the adaptive budget's
(epsilon, delta) promise is about.

Every form is ``f(q, k, [v,] draws, *, scale, **options)``: queries (..., N, D), keys (..., M, D), values (..., M, Dv),
the draws of :func:`randattn.estimators.vattention.draw` (read by :func:`select`) and, as keywords, the fields of
:class:`~randattn.estimators.vattention.rules.VattentionOptions` (``scale``: default ``D ** -0.5``; ``mask="causal"``
or ``"sliding:W"``: every set is among the visible keys). ``estimate`` returns (R, ..., N, Dv) float64:

>>> import numpy as np
>>> from randattn.estimators.vattention import draw, reference
>>> q, k, v = np.random.default_rng(0).normal(size=(3, 40, 8))
>>> fixed = dict(budget="fixed", sinks=2, local=4, top_k=4)  # the other options at their defaults
>>> draws = draw(q.shape, k.shape, num_samples=8, replicates=2, rng=np.random.default_rng(1), **fixed)
>>> reference.estimate(q, k, v, draws, **fixed).shape
(2, 40, 8)

Sources: Desai et al., "vAttention: Verified Sparse Attention" (ICLR 2026, arXiv 2510.05688): the estimator of
:math:`N` and :math:`D` and the budget theorem as the authors state them in their post "vAttention: Verified Sparse
Attention" (sky-light.eecs.berkeley.edu; skylight-org/website, ``VAttentionEntry.tsx``); the official code,
xAlg-ai/sparse-attention-hub, ``AdaptiveSamplingMasker`` (``maskers/sampling/implementations/adaptive_sampling.py``)
with ``SinkMasker``, ``LocalMasker`` and ``OracleTopK``. The paper's own section and equation numbers could not
be read here, so formulas are cited by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from randattn.estimators._prepare import prepare_reference
from randattn.estimators.base import Draws, keyword_entry
from randattn.estimators.sparse import reference as sparse_reference
from randattn.estimators.sparse.forms import WeightedKeysForms
from randattn.estimators.sparse.reference import masked_logits
from randattn.estimators.vattention.rules import (
    QuerySets, VattentionOptions, ceil_or_floor, checked_uniforms, normal_quantile, query_sets,
)

__all__ = ["Selection", "estimate", "estimate_with_probabilities", "keys_used", "log_denominator", "probabilities",
           "sample_size", "select"]


@dataclass(frozen=True)
class Selection:
    r"""What vAttention chose for every query of every replicate.

    Attributes
    ----------
    logits : (..., N, M)
        :math:`x_n^\top y_m`, ``-inf`` for hidden keys.
    heavy : (..., N, M) bool
        The heavy set :math:`I_f` (deterministic).
    log_weights : (R, ..., N, M)
        :math:`\log w_{nm}`: 0 on the heavy set, :math:`\log(c_m n_s / b)` on sampled keys, ``-inf`` elsewhere.
    sample_sizes : (R, ..., N) float64
        :math:`b`, the draws each query took (0 where nothing was sampled).
    bounds : (R, ..., N) float64
        The adaptive budget formula before rounding and clipping (:func:`sample_size`); NaN for a fixed budget
        or where nothing is sampled.
    """

    logits: np.ndarray
    heavy: np.ndarray
    log_weights: np.ndarray
    sample_sizes: np.ndarray
    bounds: np.ndarray


def sample_size(base_values: np.ndarray, base_keys: np.ndarray, exact_denominator: float, sampled_size: int, *,
                epsilon: float, delta: float, quantile: str, duplicates: str, rounding: str) -> tuple[int, float]:
    r"""The adaptive sample size of one query and one replicate: ``(b, bound)``.

    The paper's budget theorem (as stated by the authors): for a sum :math:`s = \sum_{m \in I_r} x_m` estimated by
    :math:`\hat s = \frac{n_s}{b} \sum_{i=1}^b x_{j_i}` from :math:`b` uniform draws,

    .. math::
        b \ge \left( \Phi^{-1}(1 - \delta/2) \, \frac{n_s \sqrt{\operatorname{Tr} \Sigma}}{\tau} \right)^2
        \;\Longrightarrow\; P(\lVert \hat s - s \rVert > \tau) \le \delta

    by the central limit theorem (:math:`\Sigma`: the population covariance of the :math:`x_m`). vAttention's
    practical rule (the paper's denominator-only relaxation; the official code) applies it to the denominator,
    :math:`x_m = e^{s_m}`, with :math:`\tau = \epsilon D`, both unknowns replaced by base-sample estimates:

    1. a base sample of :math:`b_0` uniform draws from :math:`I_r` (``base_values`` :math:`= e^{s_{j}}`, made
       by the caller from the ``base_uniforms``);
    2. :math:`\hat\sigma`: their sample standard deviation (``ddof=1``, as the code's ``torch.std``);
    3. :math:`\hat D = \sum_{m \in I_f} e^{s_m} + \frac{n_s}{b_0} \sum_{i=1}^{b_0} e^{s_{j_i}}` (``duplicates=
       "merge"``: each distinct base key once, as the code's mask);
    4. the bound :math:`b^* = (z \, n_s \hat\sigma / (\epsilon \hat D))^2` with :math:`z = \Phi^{-1}(1-\delta/2)`
       (``quantile="one-sided"``: :math:`\Phi^{-1}(1 - \delta)`, the code); :math:`b^* = \infty` where
       :math:`\hat D = 0` (every term underflowed: nothing is known, take the cap);
    5. :math:`b = \min(\max(b_0, \lceil b^* \rceil), n_s)` (``rounding="floor"``: :math:`\lfloor b^* \rfloor`,
       the code). The floor :math:`b_0` and the cap :math:`n_s` are the official code's clamps; the paper's bound
       has neither, and where the cap binds the (epsilon, delta) promise does not hold for that query.

    The ratio :math:`\hat\sigma / \hat D` does not change when every :math:`e^{s_m}` is multiplied by one
    constant, so the caller passes them shifted by the query's largest visible logit.

    Parameters
    ----------
    base_values : (b0,)
        :math:`e^{s_j - c}` of the base draws, duplicates included.
    base_keys : (b0,)
        Their key indices (for ``duplicates="merge"``).
    exact_denominator : float
        :math:`\sum_{m \in I_f} e^{s_m - c}`.
    sampled_size : int
        :math:`n_s`.
    """
    b0 = base_values.shape[-1]
    sigma = float(np.std(base_values, ddof=1))
    if duplicates == "count":
        base_sum = float(base_values.sum())
    else:
        _, first = np.unique(base_keys, return_index=True)
        base_sum = float(base_values[first].sum())
    denominator = exact_denominator + sampled_size / b0 * base_sum
    z = normal_quantile(delta, quantile)
    bound = (z * sampled_size * sigma / (epsilon * denominator)) ** 2 if denominator > 0 else np.inf
    size = min(max(b0, ceil_or_floor(bound, rounding)), sampled_size)
    return int(size), float(bound)


def _pick(pool: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """``pool[floor(u * len(pool))]``: uniform draws from ``pool`` (a float32 u rounded up to 1 takes the last)."""
    slots = np.minimum(np.floor(uniforms * len(pool)).astype(np.int64), len(pool) - 1)
    return pool[slots]


def _select_query(row: np.ndarray, sets: QuerySets, n: int, main: np.ndarray, base: np.ndarray | None,
                  params: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Steps 1-4 for one query: ``(heavy (M,), log_weights (R, M), sample_sizes (R,), bounds (R,))``."""
    num_keys, replicates = row.shape[0], main.shape[0]
    visible = np.flatnonzero(sets.visible[n])
    fixed_keys = np.flatnonzero(sets.sinks[n] | sets.local[n])
    candidates = np.flatnonzero(sets.candidates[n])
    by_logit = candidates[np.argsort(-row[candidates], kind="stable")]  # ties: lower index first
    heavy_keys = np.union1d(fixed_keys, by_logit[: sets.top_k[n]])
    heavy = np.zeros(num_keys, dtype=bool)
    heavy[heavy_keys] = True
    pool = candidates if params["sample_from"] == "window" else np.setdiff1d(visible, heavy_keys)
    log_weights = np.full((replicates, num_keys), -np.inf)
    log_weights[:, heavy_keys] = 0.0
    sizes, bounds = np.zeros(replicates), np.full(replicates, np.nan)
    if len(pool) == 0:
        return heavy, log_weights, sizes, bounds
    if params["sample_from"] == "window" and len(pool) < 2:
        # the official code returns a full mask when its window holds fewer than two keys
        log_weights[:, visible] = 0.0
        return heavy, log_weights, sizes, bounds
    sampled_size = len(pool)
    shifted = np.exp(row - row[visible].max())  # e^{s_m - c}; hidden keys give 0
    for r in range(replicates):
        if base is None:
            size = main.shape[-1]
        else:
            base_keys = _pick(pool, base[r, : sets.base_draws[n]])
            size, bounds[r] = sample_size(
                shifted[base_keys], base_keys, float(shifted[heavy_keys].sum()), sampled_size,
                epsilon=params["epsilon"], delta=params["delta"], quantile=params["quantile"],
                duplicates=params["duplicates"], rounding=params["rounding"])
        sizes[r] = size
        counts = np.bincount(_pick(pool, main[r, :size]), minlength=num_keys).astype(np.float64)
        sampled = (counts > 0) & ~heavy  # a draw on a heavy key (window) adds nothing: its weight stays 1
        multiplicity = counts[sampled] if params["duplicates"] == "count" else 1.0
        log_weights[r, sampled] = np.log(sampled_size / size * multiplicity)
    return heavy, log_weights, sizes, bounds


def _float64(uniforms: Any) -> np.ndarray:
    """Uniforms of the draws (numpy, or torch on the CPU) as float64 numpy."""
    return np.asarray(uniforms.detach().cpu() if hasattr(uniforms, "detach") else uniforms, dtype=np.float64)


@keyword_entry(VattentionOptions)
def select(q: Any, k: Any, draws: Draws, options: VattentionOptions) -> Selection:
    """Steps 1-4 of the module docstring for every query: the heavy set, the sample and the weights.

    Parameters
    ----------
    q, k : array_like
        Queries (..., N, D), keys (..., M, D).
    draws : Draws
        From :func:`randattn.estimators.vattention.draw` with the same parameters: ``residual_uniforms``
        ``(R, ..., N, S)`` (fixed) or ``(R, ..., N, V)`` and ``base_uniforms`` ``(R, ..., N, B)`` (adaptive; V the
        most keys a query sees).
    scale, mask, budget, sinks, local, top_k, epsilon, delta, base_rate, quantile, duplicates, sample_from, rounding
        The fields of :class:`~randattn.estimators.vattention.rules.VattentionOptions`.
    """
    params = options.parameters
    x, y, _, _, batch = prepare_reference(q, k, np.zeros((*np.shape(k)[:-1], 1)), options.scale)
    num_queries, num_keys = x.shape[-2], y.shape[-2]
    sets = query_sets(num_queries, num_keys, options.mask, params)
    main, base = checked_uniforms(draws, batch, num_queries, num_keys, params, options.mask)
    main, base = _float64(main), None if base is None else _float64(base)
    logits = masked_logits(x, y, options.mask)
    replicates = draws.replicates
    heavy = np.zeros(logits.shape, dtype=bool)
    log_weights = np.full((replicates, *logits.shape), -np.inf)
    sizes = np.zeros((replicates, *logits.shape[:-1]))
    bounds = np.full((replicates, *logits.shape[:-1]), np.nan)
    every = slice(None)
    for element in np.ndindex(*batch):
        for n in range(num_queries):
            at = (*element, n)
            heavy[at], log_weights[(every, *at)], sizes[(every, *at)], bounds[(every, *at)] = _select_query(
                logits[at], sets, n, main[(every, *at)], None if base is None else base[(every, *at)], params)
    return Selection(logits, heavy, log_weights, sizes, bounds)


estimate, estimate_with_probabilities, probabilities, keys_used, log_denominator = WeightedKeysForms.of_selection(
    VattentionOptions, select.on_options, prepare_reference, sparse_reference).entries(
    "estimate", "estimate_with_probabilities", "probabilities", "keys_used", "log_denominator")
