r"""MagicPIG in numpy float64 (the reference form): SimHash sampling, written out one query at a time.

Every formula is the paper's (Chen et al. 2024, arXiv 2410.16179v4; the package docstring lists the
conventions). For query :math:`n` (at token :math:`t_n`, the last key it may see) and key :math:`m`:

- the exact keys :math:`E_n`: the first ``sinks`` keys and the ``local`` most recent keys the query sees
  (:math:`t_n - \mathrm{local} < m \le t_n`), weight 1 (sec. 4.4, "on-device cache"); under a sliding window
  the sinks are still tokens :math:`0, \dots, \text{sinks} - 1`, so a query whose window has passed them keeps
  its local keys alone exactly (it reads no key the layer hides);
- the candidates :math:`C_n`: every other visible key, hashed and sampled;
- centring (sec. 4.3, "data pre-processing"): :math:`\bar y_m = y_m - \mu_n`, with :math:`\mu_n` the mean of the
  keys the query sees (``center="all-keys"``), of its candidates (``"hashed-keys"``) or 0 (``"none"``);
- SimHash (sec. 4.3, app. E.1): table :math:`l` gives the K-bit code :math:`[w_{lk}^\top v > 0]_{k=1..K}`;
  query and key collide in table :math:`l` iff their codes are equal;
- the key is sampled iff it collides with the query in at least ``min_collisions`` of the L tables, with
  probability (eq. 10 for two tables; the binomial tail in general)

  .. math::
      u_{nm} = P[\mathrm{Bin}(L, P_{nm}) \ge c], \quad P_{nm} = p_{nm}^K, \quad
      p_{nm} = 1 - \theta_{nm} / \pi, \quad \theta_{nm} = \angle(x_n, \bar y_m);

- the estimate (eqs. 9, 11; Algorithm 1): softmax over :math:`E_n \cup S_n` of :math:`x_n^\top y_m - \log u_{nm}` (0 for
  exact keys), so a sampled key weighs :math:`w = 1 / u`.

``log u`` is the log of the binomial tail summed in log space (``logsumexp`` over :math:`j \ge c` of
:math:`\log \binom{L}{j} + j \log P + (L - j) \log(1 - P)`), so it stays exact when :math:`u` is far below
the smallest float (no ``1 - (1 - P)^L`` cancellation, no division by an underflowed 0).

The forms (``estimate``, ``estimate_with_probabilities``, ``probabilities``, ``keys_used``: the distinct keys each
query reads, exact plus sampled) are :class:`~randattn.estimators.sparse.forms.WeightedKeysForms` over one hashing
of the keys, each ``f(q, k, [v,] draws, *, scale, **options)``: queries (..., N, D), keys (..., M, D), values
(..., M, Dv), ``hyperplanes : (R, ..., L, K, D)`` in the draws of :func:`randattn.estimators.magicpig.draw`, and
the fields of :class:`MagicpigOptions` as keywords (``hash_bits`` must match the draws). ``estimate`` returns
(R, ..., N, Dv) float64:

>>> import numpy as np
>>> from randattn.estimators.magicpig import draw
>>> from randattn.estimators.magicpig.reference import estimate
>>> rng = np.random.default_rng(0)
>>> q, k, v = rng.normal(size=(3, 12, 8))
>>> draws = draw(q.shape, k.shape, num_samples=8, replicates=2, rng=rng, hash_bits=2, sinks=1, local=2)
>>> estimate(q, k, v, draws, hash_bits=2, sinks=1, local=2).shape
(2, 12, 8)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.special import gammaln, logsumexp, xlog1py

from randattn._validation import check_choice, check_positive_int
from randattn.estimators._prepare import check_draw_array, prepare_reference
from randattn.estimators.base import Draws, EstimatorOptions, option
from randattn.estimators.masks import DECLARABLE_MASKS, Mask, check_causal_shapes, check_mask_argument
from randattn.estimators.sparse import reference as sparse_reference
from randattn.estimators.sparse.forms import WeightedKeysForms
from randattn.estimators.sparse.reference import masked_logits, visible_keys

__all__ = [
    "CENTERINGS",
    "MagicpigOptions",
    "Selection",
    "angle",
    "centering_means",
    "check_params",
    "checked_selection_params",
    "estimate",
    "exact_and_candidate_keys",
    "hash_codes",
    "keys_used",
    "log_inclusion_probability",
    "log_table_collision_probability",
    "probabilities",
    "select",
    "tail_terms",
]

#: how keys are centred before hashing: the paper's mean of every key the query sees (sec. 4.3), the official
#: code's mean of the hashed keys only (``models/attnserver.py``, ``fill``: the keys between the sinks and the
#: local window), or no centring
CENTERINGS = ("all-keys", "hashed-keys", "none")


@dataclass(frozen=True, kw_only=True)
class MagicpigOptions(EstimatorOptions):
    """MagicPIG's keyword options, declared once: the spec's ``params``, ``draw``'s and every form's keywords.

    Made (and so checked) before any input is read: ``hash_bits, min_collisions >= 1``, ``sinks, local >= 0`` with
    ``sinks + local >= 1`` (``local >= 1`` under a sliding window), ``center`` in :data:`CENTERINGS`, ``mask``
    None, ``"causal"`` or ``"sliding:W"``; L = ``num_samples`` is checked against them where it is known
    (:meth:`check_tables`, in ``draw``; :meth:`check_hyperplanes`, from the draws, in every form).
    """

    hash_bits: int = option(10, "K, SimHash bits (hyperplanes) per table (paper: K = 8-10; headline (K, L) = (10, "
                            "150))", kind=int)
    min_collisions: int = option(2, "tables in which a key must share the query's code to be sampled (2: paper eq. 10 "
                                 "and official code; 1: sparse-attention-hub)", kind=int)
    sinks: int = option(4, "first keys computed exactly, never sampled (paper sec. 5.1: 4)", kind=int)
    local: int = option(64, "most recent keys computed exactly, never sampled (paper sec. 5.1: 64; 24 for lm-eval)",
                        kind=int)
    center: str = option("all-keys", "what the keys are centred on before hashing: the mean of the keys the query "
                         "sees (paper sec. 4.3), of the hashed keys only (official code), or nothing",
                         choices=CENTERINGS)
    mask: str | None = None

    def check(self) -> None:
        check_positive_int("hash_bits", self.hash_bits)
        check_positive_int("min_collisions", self.min_collisions)
        sinks = check_positive_int("sinks", self.sinks, minimum=0)
        local = check_positive_int("local", self.local, minimum=0)
        check_choice("center", self.center, CENTERINGS)
        if sinks + local < 1:
            raise ValueError(f"sinks + local must be >= 1 so that every query keeps an exact key (a query may sample "
                             f"no key at all), got sinks={sinks}, local={local}")
        check_mask_argument(self.mask, DECLARABLE_MASKS)
        if local < 1 and Mask.parse(self.mask).window is not None:
            raise ValueError(f"local must be >= 1 under mask={self.mask!r}: the window passes the sink keys, and the "
                             f"local keys are then the only exact keys a query keeps (it may sample none), got "
                             f"local={local}")

    def check_tables(self, tables: Any) -> int:
        """L = ``num_samples``, the number of hash tables, as an int: at least ``min_collisions``."""
        tables = check_positive_int("num_samples (L, the number of hash tables)", tables)
        if self.min_collisions > tables:
            raise ValueError(f"min_collisions={self.min_collisions} exceeds the number of hash tables L = "
                             f"num_samples = {tables}: no key could ever be sampled; use min_collisions <= "
                             "num_samples")
        return tables

    def check_hyperplanes(self, hyperplane_shape: tuple[int, ...]) -> None:
        """The draws' hyperplanes ``(R, ..., L, K, D)`` against the options: L tables (:meth:`check_tables`), K =
        ``hash_bits``; shared by the reference and batched forms."""
        self.check_tables(hyperplane_shape[-3])
        if hyperplane_shape[-2] != self.hash_bits:
            raise ValueError(f"the draws hold {hyperplane_shape[-2]} hyperplanes per table but "
                             f"hash_bits={self.hash_bits}: were they drawn with another hash_bits?")

    @property
    def selection_keywords(self) -> dict[str, Any]:
        """The keywords of :func:`select` (and of the batched ``log_weights``)."""
        return dict(min_collisions=self.min_collisions, sinks=self.sinks, local=self.local, center=self.center,
                    mask=self.mask)


def check_params(*, hash_bits: Any, min_collisions: Any, sinks: Any, local: Any, center: Any,
                 tables: Any = None) -> tuple[int, int, int, int, int | None]:
    """``(hash_bits, min_collisions, sinks, local, tables)`` after :class:`MagicpigOptions` checked them;
    ValueError/TypeError naming the parameter and the allowed range. ``tables`` (L = num_samples) is checked when
    given (:meth:`MagicpigOptions.check_tables`)."""
    options = MagicpigOptions(hash_bits=hash_bits, min_collisions=min_collisions, sinks=sinks, local=local,
                              center=center)
    return hash_bits, min_collisions, sinks, local, None if tables is None else options.check_tables(tables)


def exact_and_candidate_keys(num_queries: int, num_keys: int, sinks: int, local: int,
                             mask: str | None) -> tuple[np.ndarray, np.ndarray]:
    """``(exact, candidates)``, each ``(N, M)`` boolean.

    ``exact``: the visible keys among the first ``sinks`` keys and the ``local`` most recent keys the query sees
    (:math:`t_n - \\mathrm{local} < m \\le t_n`, :math:`t_n = n + M - N` under a causal or sliding mask,
    :math:`M - 1` without one); ``candidates``: every other visible key (the ones MagicPIG hashes and samples).
    """
    visible = visible_keys(num_queries, num_keys, mask)
    keys = np.arange(num_keys)
    last = (np.arange(num_queries) + num_keys - num_queries if mask is not None
            else np.full(num_queries, num_keys - 1))  # t_n: the most recent key query n sees
    exact = visible & ((keys[None, :] < sinks) | (keys[None, :] > last[:, None] - local))
    return exact, visible & ~exact


def centering_means(y: np.ndarray, visible: np.ndarray, candidates: np.ndarray, center: str) -> np.ndarray:
    """``(..., N, D)``: the vector :math:`\\mu_n` subtracted from the keys before hashing for query n.

    ``all-keys``: the mean of the keys query n sees (paper sec. 4.3, :math:`\\bar k_i = k_i - \\frac1n \\sum k_i` over
    its context); ``hashed-keys``: the mean of its candidates (official code); ``none``: 0. A query without
    candidates samples nothing, so its mean does not matter (0).

    A channel in which every key averaged holds the same value has that value as its mean, exactly (the mean of
    equal numbers is the number): a rounded sum divided by the count may miss it by an ulp, in one way here and
    in another in the batched form, and a key among identical keys would then centre to rounding noise, whose
    SimHash code and angle decide its sampling and weight (:mod:`randattn.estimators.magicpig`, "Centring").
    Elsewhere the mean is the rounded one, unchanged.
    """
    check_choice("center", center, CENTERINGS)
    means = np.zeros((*y.shape[:-2], visible.shape[0], y.shape[-1]))
    if center == "none":
        return means
    rows = visible if center == "all-keys" else candidates
    for n in range(rows.shape[0]):
        if rows[n].any():
            averaged = y[..., rows[n], :]
            first = averaged[..., 0, :]
            constant = (averaged == first[..., None, :]).all(axis=-2)
            means[..., n, :] = np.where(constant, first, averaged.mean(axis=-2))
    return means


def hash_codes(vectors: np.ndarray, hyperplanes: np.ndarray) -> np.ndarray:
    """SimHash codes ``(..., L, K)`` boolean: bit k of table l is :math:`[w_{lk}^\\top v > 0]` (paper sec. 4.3).

    ``vectors (..., D)`` broadcast against ``hyperplanes (..., L, K, D)``. A zero vector gets the all-zero code
    (the official code's ``> 0``).
    """
    tables, bits, dim = hyperplanes.shape[-3:]
    flat = np.swapaxes(hyperplanes.reshape(*hyperplanes.shape[:-3], tables * bits, dim), -1, -2)  # (..., D, L K)
    projections = np.matmul(vectors[..., None, :], flat)[..., 0, :]  # w_lk . v, one product per vector
    return projections.reshape(*projections.shape[:-1], tables, bits) > 0


def _key_codes(keys: np.ndarray, hyperplanes: np.ndarray) -> np.ndarray:
    """:func:`hash_codes` of ``keys (..., M, D)`` in every table of ``hyperplanes (R, ..., L, K, D)``:
    ``(R, ..., M, L, K)``, by one matrix product per replicate and batch element."""
    tables, bits, dim = hyperplanes.shape[-3:]
    flat = np.swapaxes(hyperplanes.reshape(*hyperplanes.shape[:-3], tables * bits, dim), -1, -2)  # (R, ..., D, LK)
    projections = np.matmul(keys, flat)  # (R, ..., M, L K)
    return projections.reshape(*projections.shape[:-1], tables, bits) > 0


def angle(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The angle between ``a`` and ``b`` along the last axis, in [0, pi].

    :math:`\\theta = 2\\,\\mathrm{atan2}(|\\hat a - \\hat b|, |\\hat a + \\hat b|)` (Kahan): the paper's
    :math:`\\arccos(a^\\top b / |a||b|)`, but accurate near 0 and pi where arccos loses half the digits. A zero
    vector has unit vector 0, which gives pi/2 against any other vector and 0 against a zero vector: exactly the
    collision probabilities of the all-zero code (1/2 per bit, or always).
    """
    def unit(w: np.ndarray) -> np.ndarray:
        norm = np.linalg.norm(w, axis=-1, keepdims=True)
        return w / np.where(norm > 0, norm, 1.0)

    ua, ub = unit(a), unit(b)
    return 2.0 * np.arctan2(np.linalg.norm(ua - ub, axis=-1), np.linalg.norm(ua + ub, axis=-1))


def log_table_collision_probability(x: np.ndarray, centered_keys: np.ndarray, hash_bits: int) -> np.ndarray:
    """:math:`\\log P = K \\log(1 - \\theta / \\pi)`: the log probability that query ``x (..., D)`` and a key of
    ``centered_keys (..., M, D)`` share their K-bit code in one table (Charikar 2002; paper eq. 10), ``(..., M)``."""
    theta = angle(x[..., None, :], centered_keys)
    with np.errstate(divide="ignore"):  # theta = pi: the codes never agree, log P = -inf
        return hash_bits * np.log1p(-theta / np.pi)


def tail_terms(tables: int, min_collisions: int) -> tuple[np.ndarray, np.ndarray]:
    r"""``(j, log C(L, j))`` for :math:`j = 0, \dots, L`, float64 (the batched form uses the same numbers)."""
    j = np.arange(tables + 1, dtype=np.float64)
    return j, gammaln(tables + 1.0) - gammaln(j + 1.0) - gammaln(tables - j + 1.0)


def log_inclusion_probability(log_table_probability: np.ndarray, tables: int, min_collisions: int) -> np.ndarray:
    r"""``log u``: the log probability that a key collides with the query in at least ``min_collisions`` of
    ``tables`` independent tables, each with probability :math:`P = e^{\log P}` (paper eq. 10 for 2 tables).

    .. math::
        \log u = \log \sum_{j=c}^{L} \binom{L}{j} P^j (1 - P)^{L - j}
                = \log\Bigl(1 - \sum_{j=0}^{c-1} \binom{L}{j} P^j (1 - P)^{L - j}\Bigr),

    in log space (Maechler 2012, "log1mexp"): the upper sum where :math:`u < 1/2`, exact however far :math:`u`
    falls below the smallest float (no :math:`1 - (1 - P)^L` cancellation, no division by an underflowed 0); the
    lower tail through ``log1p`` where :math:`u \ge 1/2`, exact as :math:`u \to 1`. :math:`0 \log 0 = 0`, so
    :math:`P = 1` gives 0; :math:`P = 0` gives ``-inf``.
    """
    j, log_binomial = tail_terms(tables, min_collisions)
    log_p = log_table_probability[..., None]
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        # j log P from log P itself (P may underflow), 0 at j = 0 even where log P = -inf; (L - j) log(1 - P) is 0 at
        # j = L even where P = 1 (xlog1py)
        terms = log_binomial + np.where(j > 0, j * log_p, 0.0) + xlog1py(tables - j, -np.exp(log_p))
        upper = logsumexp(terms[..., min_collisions:], axis=-1)
        lower = logsumexp(terms[..., :min_collisions], axis=-1)
        return np.where(lower <= -np.log(2.0), np.log1p(-np.exp(lower)), upper)


@dataclass(frozen=True)
class Selection:
    """What MagicPIG does with each (replicate, query, key).

    Attributes
    ----------
    log_weights : (R, ..., N, M)
        ``0`` for exact keys, ``-log u`` for sampled keys, ``-inf`` for keys left out (and hidden keys).
    sampled : (R, ..., N, M) bool
        Candidates that collided with the query in at least ``min_collisions`` tables.
    collisions : (R, ..., N, M) int
        Tables in which the (centred) key's code equals the query's.
    log_inclusion : (..., N, M)
        ``log u`` for every candidate (``-inf`` elsewhere): the same for every replicate.
    exact : (N, M) bool
    candidates : (N, M) bool
    """

    log_weights: np.ndarray
    sampled: np.ndarray
    collisions: np.ndarray
    log_inclusion: np.ndarray
    exact: np.ndarray
    candidates: np.ndarray


def select(x: np.ndarray, y: np.ndarray, hyperplanes: np.ndarray, *, min_collisions: int, sinks: int, local: int,
           center: str, mask: str | None = None) -> Selection:
    """MagicPIG's keys and weights for each query (paper Algorithm 1, one query at a time).

    Parameters
    ----------
    x : (..., N, D)
        Scaled queries :math:`x = q \\sqrt{scale}` (hashing is scale invariant; only the weights' logits use it).
    y : (..., M, D)
        Scaled keys.
    hyperplanes : (R, ..., L, K, D)
        The K x L SimHash directions of each replicate and batch element.
    """
    num_queries, num_keys = x.shape[-2], y.shape[-2]
    tables, hash_bits = hyperplanes.shape[-3], hyperplanes.shape[-2]
    exact, candidates = exact_and_candidate_keys(num_queries, num_keys, sinks, local, mask)
    visible = exact | candidates
    means = centering_means(y, visible, candidates, center)
    replicates = hyperplanes.shape[0]
    collisions = np.zeros((replicates, *x.shape[:-2], num_queries, num_keys), dtype=np.int64)
    log_inclusion = np.full((*x.shape[:-2], num_queries, num_keys), -np.inf)
    for n in range(num_queries):
        if not candidates[n].any():  # sinks and local window hold every key this query sees: nothing to hash
            continue
        centered = y - means[..., n, None, :]  # (..., M, D): the keys as this query's hash tables hold them
        query_code = hash_codes(x[..., n, :], hyperplanes)  # (R, ..., L, K)
        key_codes = _key_codes(centered, hyperplanes)  # (R, ..., M, L, K)
        agree = (key_codes == query_code[..., None, :, :]).all(axis=-1)  # (R, ..., M, L): same bucket in table l
        collisions[..., n, :] = agree.sum(axis=-1)
        # one query's binomial tails at a time: (..., M, L + 1) terms, not (..., N, M, L + 1)
        log_table_p = log_table_collision_probability(x[..., n, :], centered, hash_bits)
        log_inclusion[..., n, :] = np.where(candidates[n], log_inclusion_probability(log_table_p, tables,
                                                                                     min_collisions), -np.inf)
    sampled = candidates & (collisions >= min_collisions)
    with np.errstate(invalid="ignore"):
        log_weights = np.where(exact, 0.0, np.where(sampled, -log_inclusion, -np.inf))
    return Selection(log_weights, sampled, collisions, log_inclusion, exact, candidates)


def _prepared(q: Any, k: Any, v: Any, draws: Draws, options: MagicpigOptions):
    """``(x, y, v, hyperplanes)`` after every check of the inputs and draws against the options."""
    x, y, v, _, batch = prepare_reference(q, k, v, options.scale)
    if options.mask is not None:
        check_causal_shapes(x.shape[-2], y.shape[-2])
    hyperplanes = np.asarray(check_draw_array(draws, "hyperplanes", batch, (None, None, x.shape[-1])),
                             dtype=np.float64)
    options.check_hyperplanes(hyperplanes.shape)
    return x, y, v, hyperplanes


def checked_selection_params(hyperplane_shape: tuple[int, ...], params: dict[str, Any]) -> dict[str, Any]:
    """The parameters :func:`select` takes but ``mask``, checked against each other and against the draws'
    hyperplanes ``(R, ..., L, K, D)`` (:meth:`MagicpigOptions.check_hyperplanes`)."""
    options = MagicpigOptions(**params)
    options.check_hyperplanes(hyperplane_shape)
    return {name: value for name, value in options.selection_keywords.items() if name != "mask"}


def _weighted_scores(q: Any, k: Any, v: Any, draws: Draws, options: MagicpigOptions
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(logits, log_weights, v)`` of one hashing of the keys (:class:`~randattn.estimators.sparse.forms.
    WeightedKeysForms`): the masked logits and ``-log u`` on the sampled keys, 0 on the exact ones."""
    x, y, v, hyperplanes = _prepared(q, k, v, draws, options)
    chosen = select(x, y, hyperplanes, **options.selection_keywords)
    return masked_logits(x, y, options.mask), chosen.log_weights, v


estimate, estimate_with_probabilities, probabilities, keys_used = WeightedKeysForms(
    MagicpigOptions, _weighted_scores, sparse_reference).entries(
    "estimate", "estimate_with_probabilities", "probabilities", "keys_used")
