r"""What vAttention's reference and batched forms share: the parameters, their checks, and each query's sets.

Everything here depends on positions and parameters only, never on the data: which keys a query sees, its
sinks and local window, how many top-k keys it keeps, how large the set it samples from is, and how many
uniforms :func:`~randattn.estimators.vattention.draw` must make. The top-k choice itself (by logit) and the
sampling are data- and draw-dependent and live in :mod:`.reference` and :mod:`.batched`.

Sizes. A size parameter (``sinks``, ``local``, ``top_k``) is a count when it is an ``int`` and a fraction of the
query's visible keys when it is a ``float`` (the paper writes the sets' sizes as :math:`f_s n`, :math:`f_l n`,
:math:`f_t n`; the official code accepts either and turns a fraction :math:`f` into ``int(f * n)``, the floor).
A count larger than the visible keys keeps them all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
from scipy.special import ndtri

from randattn._validation import check_choice
from randattn.estimators._prepare import check_draw_array
from randattn.estimators.base import Draws, EstimatorOptions, option
from randattn.estimators.masks import DECLARABLE_MASKS, Mask, check_causal_shapes, check_mask_argument

__all__ = [
    "BUDGETS", "DUPLICATES", "PARAMS", "QUANTILES", "ROUNDINGS", "SAMPLE_FROM", "QuerySets", "QuerySizes",
    "VattentionOptions", "base_uniform_count", "check_params", "checked_uniforms", "normal_quantile", "query_sets",
    "most_visible_keys", "query_sizes", "size_of", "uniform_counts",
]

#: ``adaptive``: the sample size from the CLT budget for (epsilon, delta) (the paper); ``fixed``: S draws
BUDGETS = ("adaptive", "fixed")
#: ``two-sided``: :math:`\Phi^{-1}(1 - \delta/2)` (the paper's budget theorem); ``one-sided``:
#: :math:`\Phi^{-1}(1 - \delta)` (the official code's ``norm.ppf(1 - delta)``)
QUANTILES = ("two-sided", "one-sided")
#: ``count``: every draw counts, a key drawn c times gets weight c n/b (the paper's sum over the sample: unbiased);
#: ``merge``: a key drawn any number of times gets weight n/b once (the official code's mask assignment)
DUPLICATES = ("count", "merge")
#: ``residual``: draw among the visible keys outside the heavy set (the paper); ``window``: draw among the keys
#: between the sinks and the local window, top-k keys included, a draw on a top-k key adding nothing (the code)
SAMPLE_FROM = ("residual", "window")
#: rounding of the budget formula: ``ceil`` (the smallest b with b >= the bound; the paper) or ``floor`` (the
#: code's ``.long()``)
ROUNDINGS = ("ceil", "floor")

_SIZES = ("sinks", "local", "top_k")
_SIZE_KINDS = (int, float)

@dataclass(frozen=True, kw_only=True)
class VattentionOptions(EstimatorOptions):
    """vAttention's keyword options, declared once: the spec's ``params``, ``draw``'s and every form's keywords.

    The defaults are the authors' published configuration (their post's vAttention(PQCache) config,
    skylight-org/website ``VAttentionEntry.tsx``: sink_size=128, window_size=128, heavy_size=0.1,
    base_rate_sampling=0.05, epsilon=0.05, delta=0.05) with the paper's conventions; ``official-code`` (the spec's
    preset) switches the four conventions to the official code's. Made, they hold the values :func:`check_params`
    returns (a count as ``int``, a fraction as ``float``), which every form reads as :attr:`parameters`.
    """

    mask: str | None = None
    budget: str = option("adaptive", "sample size: 'adaptive' = the CLT budget for (epsilon, delta) (the paper; S "
                         "is then ignored), 'fixed' = S draws", choices=BUDGETS)
    sinks: int | float = option(128, "attention sinks, the first keys (int: a count; float: a fraction of the "
                                "visible keys)", kind=_SIZE_KINDS)
    local: int | float = option(128, "local window, the keys ending at the query's own position (int: count; "
                                "float: fraction)", kind=_SIZE_KINDS)
    top_k: int | float = option(0.1, "top-k keys by logit among the rest (int: count; float: fraction of the "
                                "visible keys)", kind=_SIZE_KINDS)
    epsilon: float = option(0.05, "relative error of the denominator the adaptive budget aims at, in (0, 1)",
                            kind=(int, float))
    delta: float = option(0.05, "probability the adaptive budget allows that error to be exceeded, in (0, 1)",
                          kind=(int, float))
    base_rate: int | float = option(0.05, "base sample of the adaptive budget (int: draws >= 2; float: fraction of "
                                    "the keys sampled from, at least 2 draws)", kind=_SIZE_KINDS)
    quantile: str = option("two-sided", "normal quantile of the budget: Phi^-1(1 - delta/2) (paper) or "
                           "Phi^-1(1 - delta) (official code)", choices=QUANTILES)
    duplicates: str = option("count", "a key drawn c times weighs c n/b (paper, unbiased) or n/b once (official "
                             "code, biased low)", choices=DUPLICATES)
    sample_from: str = option("residual", "draw among the visible keys outside the heavy set (paper) or between the "
                              "sinks and the local window, top-k keys included (official code)", choices=SAMPLE_FROM)
    rounding: str = option("ceil", "the budget bound rounded up (paper: b >= bound) or down (official code)",
                           choices=ROUNDINGS)

    def check(self) -> None:
        check_mask_argument(self.mask, DECLARABLE_MASKS)
        # keep the checked values (a count as int, a fraction as float): the forms compute with them, as before
        for name, value in check_params(self.parameters).items():
            object.__setattr__(self, name, value)

    @property
    def parameters(self) -> dict[str, Any]:
        """The estimator parameters (every field but ``scale`` and ``mask``), name -> value."""
        return {name: getattr(self, name) for name in self.params()}


#: the parameters and their defaults, declared once as the fields of :class:`VattentionOptions`
PARAMS = VattentionOptions.params()


def _is_count(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_fraction(value: Any) -> bool:
    return isinstance(value, (float, np.floating))


def _check_count_or_fraction(name: str, value: Any, *, min_count: int = 0, zero_fraction: bool = True,
                             of: str = "of the visible keys", why: str = "") -> int | float:
    """A count ``>= min_count`` (int) or a fraction in ``[0, 1]`` (``(0, 1]`` unless ``zero_fraction``) of what
    ``of`` says (float); TypeError/ValueError naming ``name`` (``why``: the reason for the bound, if any)."""
    unit = "[0, 1]" if zero_fraction else "(0, 1]"
    if _is_count(value):
        if value < min_count:
            raise ValueError(f"{name} must be a count >= {min_count} (int{why}) or a fraction {of} in {unit} "
                             f"(float), got {value}")
        return int(value)
    if _is_fraction(value):
        if not (0.0 <= value <= 1.0 if zero_fraction else 0.0 < value <= 1.0):
            raise ValueError(f"{name} must be a count >= {min_count} (int) or a fraction {of} in {unit} (float), "
                             f"got {value}")
        return float(value)
    raise TypeError(f"{name} must be an int (a count) or a float (a fraction {of}), got {type(value).__name__} "
                    f"{value!r}")


def _check_open_unit(name: str, value: Any) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a float in (0, 1), got {type(value).__name__} {value!r}")
    if not 0.0 < float(value) < 1.0:
        raise ValueError(f"{name} must be in (0, 1) (both ends excluded), got {value}")
    return float(value)


def check_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """The parameters checked in one place (``draw``, both ``estimate`` forms): errors name the parameter.

    Missing parameters take their defaults (:data:`PARAMS`).

    Raises
    ------
    TypeError, ValueError
        A size that is neither a count >= 0 nor a fraction in [0, 1]; ``epsilon`` or ``delta`` outside (0, 1);
        a base rate below 2 draws or outside (0, 1]; a convention outside its choices; an unknown parameter.
    """
    unknown = sorted(set(params) - set(PARAMS))
    if unknown:
        raise TypeError(f"unknown vAttention parameter(s) {', '.join(map(repr, unknown))}; allowed: "
                        f"{', '.join(PARAMS)}")
    checked = {**{name: param.default for name, param in PARAMS.items()}, **params}
    params = checked
    for name in _SIZES:
        checked[name] = _check_count_or_fraction(name, params[name])
    checked["base_rate"] = _check_count_or_fraction("base_rate", params["base_rate"], min_count=2, zero_fraction=False,
                                                   of="of the keys sampled from",
                                                   why="; the base sample estimates a standard deviation")
    checked["epsilon"] = _check_open_unit("epsilon", params["epsilon"])
    checked["delta"] = _check_open_unit("delta", params["delta"])
    for name, allowed in (("budget", BUDGETS), ("quantile", QUANTILES), ("duplicates", DUPLICATES),
                          ("sample_from", SAMPLE_FROM), ("rounding", ROUNDINGS)):
        checked[name] = check_choice(name, params[name], allowed)
    return checked


def size_of(value: int | float, available: np.ndarray) -> np.ndarray:
    """Keys a size parameter stands for with ``available`` keys: ``min(count, available)`` or
    ``floor(fraction * available)``."""
    available = np.asarray(available)
    if _is_count(value):
        return np.minimum(int(value), available)
    return np.floor(float(value) * available).astype(np.int64)


def normal_quantile(delta: float, quantile: str) -> float:
    r"""The budget formula's normal quantile: :math:`\Phi^{-1}(1 - \delta/2)` (two-sided, the paper's theorem)
    or :math:`\Phi^{-1}(1 - \delta)` (one-sided, the official code)."""
    tail = delta / 2 if quantile == "two-sided" else delta
    return float(-ndtri(tail))  # Phi^-1(1 - tail), without the rounding of 1 - tail


def base_uniform_count(base_rate: int | float, available: int) -> int:
    r"""Base-sample draws for ``available`` keys to sample from: :math:`\max(2, \text{size})` (the official code's
    ``max(2, ...)``: two draws at least, since they estimate a standard deviation)."""
    return int(max(2, size_of(base_rate, np.asarray(available))))


@dataclass(frozen=True)
class QuerySets:
    """The position-only sets of N queries over M keys (``(N, M)`` booleans, ``(N,)`` counts).

    Attributes
    ----------
    visible : (N, M) bool
        Keys the query sees (every key; ``m <= n + M - N`` under the causal mask; the last W of those under
        ``"sliding:W"``).
    sinks : (N, M) bool
        The visible keys among the first ``sinks`` keys of the sequence (positions ``0 .. s - 1``, ``s`` the size
        of ``sinks`` for the query's visible keys): a sliding window that has passed them leaves none.
    local : (N, M) bool
        The ``local`` keys ending at the query's own position ``t_n = n + M - N`` (keys ``t_n - l + 1 .. t_n``;
        under the causal mask its most recent visible keys).
    top_k : (N,) int
        How many top-k keys the query keeps: ``min(size(top_k), candidates)``, candidates being the visible keys
        outside the sinks and the local window.
    sample_from : (N, M) bool or None
        The keys between the sinks and the local window (``sample_from="window"``); None for ``"residual"``, whose
        keys depend on the top-k choice (its size is still known: ``sampled_size``).
    sampled_size : (N,) int
        ``n`` of the reweighting ``n / b``: the residual's size (visible keys minus the heavy set) or the window's.
    base_draws : (N,) int
        Base-sample draws (adaptive budget), ``max(2, size(base_rate, sampled_size))``.
    """

    visible: np.ndarray
    sinks: np.ndarray
    local: np.ndarray
    top_k: np.ndarray
    sample_from: np.ndarray | None
    sampled_size: np.ndarray
    base_draws: np.ndarray

    @property
    def candidates(self) -> np.ndarray:
        """``(N, M)``: visible keys outside the sinks and the local window (the top-k is chosen among them)."""
        return self.visible & ~self.sinks & ~self.local


def query_sets(num_queries: int, num_keys: int, mask: str | None, params: Mapping[str, Any]) -> QuerySets:
    """The sets of :class:`QuerySets` for N = ``num_queries`` queries over M = ``num_keys`` keys."""
    visible = Mask.parse(mask).visible(num_queries, num_keys)
    if visible is None:
        visible = np.ones((num_queries, num_keys), dtype=bool)
    available = visible.sum(-1)
    position = np.arange(num_keys)[None, :]
    own = (np.arange(num_queries) + (num_keys - num_queries))[:, None]  # t_n, the query's own token
    sinks = visible & (position < size_of(params["sinks"], available)[:, None])
    local = visible & (position <= own) & (position > own - size_of(params["local"], available)[:, None])
    candidates = visible & ~sinks & ~local
    top_k = np.minimum(size_of(params["top_k"], available), candidates.sum(-1))
    if params["sample_from"] == "window":
        sample_from, sampled_size = candidates, candidates.sum(-1)
    else:
        sample_from, sampled_size = None, candidates.sum(-1) - top_k
    base = np.array([base_uniform_count(params["base_rate"], n) for n in sampled_size], dtype=np.int64)
    return QuerySets(visible, sinks, local, top_k, sample_from, sampled_size.astype(np.int64), base)


@dataclass(frozen=True)
class QuerySizes:
    """The ``(N,)`` sizes behind :class:`QuerySets`, from the positions alone and without any ``(N, M)`` array:
    what a form that makes the sets where it computes (an accelerator) needs from the host.

    Attributes
    ----------
    own : (N,) int
        ``t_n = n + M - N``, the query's own position (its local window ends there).
    available, sinks, local : (N,) int
        Visible keys (the ``available`` keys ending at ``t_n`` under a mask, every key without one), the sink count
        and the local window's length in keys.
    top_k, sampled_size, base_draws : (N,) int
        As in :class:`QuerySets`.
    """

    own: np.ndarray
    available: np.ndarray
    sinks: np.ndarray
    local: np.ndarray
    top_k: np.ndarray
    sampled_size: np.ndarray
    base_draws: np.ndarray


def query_sizes(num_queries: int, num_keys: int, mask: str | None, params: Mapping[str, Any]) -> QuerySizes:
    """:class:`QuerySizes` by interval arithmetic, equal to :func:`query_sets`' counts.

    The visible keys are ``[f_n, f_n + a_n)``: ``f_n = 0`` and ``a_n = M`` without a mask, ``a_n = t_n + 1`` causal,
    ``f_n = max(0, t_n - W + 1)`` and ``a_n = t_n + 1 - f_n`` under ``"sliding:W"``. The sinks are ``[0, s_n)``
    with ``s_n <= a_n``, the local window ``[lo_n, t_n]`` with ``lo_n = max(f_n, t_n - l_n + 1)`` (empty where
    ``t_n < 0``), each cut to the visible keys; the candidates are the visible keys in neither:
    ``a_n - |sinks| - |local| + |sinks & local|``.
    """
    mask = Mask.parse(mask)
    if mask.masked:
        check_causal_shapes(num_queries, num_keys)
    own = np.arange(num_queries, dtype=np.int64) + (num_keys - num_queries)
    available = mask.visible_counts(num_queries, num_keys)
    first = own + 1 - available if mask.masked else np.zeros(num_queries, dtype=np.int64)
    sinks = np.asarray(size_of(params["sinks"], available), dtype=np.int64)
    local = np.asarray(size_of(params["local"], available), dtype=np.int64)
    low = np.maximum(first, own - local + 1)
    in_sinks = np.maximum(0, np.minimum(sinks, first + available) - first)
    in_local = np.maximum(0, own - low + 1) * (local > 0)
    overlap = np.maximum(0, np.minimum(sinks, own + 1) - low) * (local > 0)
    candidates = available - in_sinks - in_local + overlap
    top_k = np.minimum(size_of(params["top_k"], available), candidates).astype(np.int64)
    sampled_size = candidates if params["sample_from"] == "window" else candidates - top_k
    base = np.array([base_uniform_count(params["base_rate"], n) for n in sampled_size], dtype=np.int64)
    return QuerySizes(own, available, sinks, local, top_k, sampled_size.astype(np.int64), base)


def most_visible_keys(num_queries: int, num_keys: int, mask: str | None) -> int:
    """The most keys any of N queries sees over M: M without a mask and under ``causal`` (the last query),
    ``min(W, M)`` under ``sliding:W``."""
    return int(Mask.parse(mask).visible_counts(num_queries, num_keys).max(initial=0))


def uniform_counts(visible: int, num_samples: int, params: Mapping[str, Any]) -> tuple[int, int]:
    """``(main, base)`` uniforms per query that ``draw`` makes: ``(S, 0)`` for a fixed budget; ``(V, largest base
    sample)`` for the adaptive one, whose sample size is capped at the keys sampled from, which are among the
    query's visible keys: at most ``visible``, the most any query sees (:func:`most_visible_keys`)."""
    if params["budget"] == "fixed":
        return num_samples, 0
    return visible, base_uniform_count(params["base_rate"], visible)


def checked_uniforms(draws: Draws, batch: tuple[int, ...], num_queries: int, num_keys: int,
                     params: Mapping[str, Any], mask: str | None) -> tuple[Any, Any]:
    """``(residual_uniforms, base_uniforms or None)`` of the draws, as they are (numpy or torch), after checking their
    layout against the inputs, the budget and the mask: the checks of both forms, with the same messages."""
    main = check_draw_array(draws, "residual_uniforms", (*batch, num_queries), (None,))
    if params["budget"] == "fixed":
        return main, None
    if "base_uniforms" not in draws:
        raise ValueError("budget='adaptive' needs the draws' 'base_uniforms'; these draws were made for "
                         "budget='fixed' (pass the same parameters to draw() and estimate())")
    visible = most_visible_keys(num_queries, num_keys, mask)
    want_main, want_base = uniform_counts(visible, 1, params)
    try:
        check_draw_array(draws, "residual_uniforms", (*batch, num_queries), (want_main,))
        return main, check_draw_array(draws, "base_uniforms", (*batch, num_queries), (want_base,))
    except ValueError as exc:
        raise ValueError(f"{exc} (or under another mask: budget='adaptive' draws uniforms for the {visible} keys "
                         f"that a query sees at most under mask={mask!r}; pass the same mask to draw() and "
                         "estimate())") from None


def ceil_or_floor(value: float, rounding: str) -> float:
    """``ceil`` or ``floor`` of a budget bound (``inf`` stays ``inf``)."""
    if math.isinf(value):
        return value
    return float(math.ceil(value) if rounding == "ceil" else math.floor(value))
