"""The log-space SNIS skeleton shared by every random-feature estimator (ARCHITECTURE sec. 4).

``reference`` (numpy float64) and ``batched`` (torch) compute, for each query n,

    y_n = sum_j a_nj * sum_m b_mj v_m  /  sum_j a_nj * sum_m b_mj

with query-side features ``a_nj = sign * exp(log_a)`` and key-side features
``b_mj = sign * exp(log_b)`` over a shared feature index j = (sample s, component l).
RFA is this with random features; LARA adds ``log|alpha'_nc|`` and its sign to the query
side (LARA eq. 28). It costs O((N + M) J Dv) and never builds an N x M matrix.
"""

from __future__ import annotations



import warnings
from typing import Any

import numpy as np

from randattn._callers import outside_stacklevel


class NonPositiveDenominatorWarning(RuntimeWarning):
    """A signed-feature or signed-weight estimate whose normalizer is zero or negative for some queries.

    Raised by RFA with trigonometric features and by LARA with negative weighting
    functions (eq. 37-38): those queries' outputs are not meaningful. Reported, not hidden
    (no epsilon is added to the normalizer, ARCHITECTURE sec. 4).
    """


def flatten_features(log_f: Any) -> Any:
    """``(..., T, S, L) -> (..., T, S*L)``: one feature index j = (s, l); numpy arrays and torch tensors alike."""
    return log_f.reshape(*log_f.shape[:-2], log_f.shape[-2] * log_f.shape[-1])


def count_non_positive(sign: Any) -> int:
    """How many entries of ``sign`` are <= 0, read back to the host (the device sync of a signed estimator)."""
    return int((sign <= 0).sum())


def warn_non_positive(sign: Any, why: str, stacklevel: int | None = None) -> None:
    """Warn once per call when any entry of the denominator signs ``sign`` is <= 0.

    ``sign`` is a numpy array or torch tensor of any shape (one entry per query). On an accelerator this is the
    one read back to the host that a signed estimator makes per call (:func:`count_non_positive`): the report
    is worth a synchronisation (precision first), and positive estimators never make it. The warning points at
    the first caller outside randattn (:func:`randattn._callers.outside_stacklevel`) unless ``stacklevel`` is
    given.
    """
    bad = count_non_positive(sign)
    if bad:
        total = int(np.prod(tuple(sign.shape)))
        warnings.warn(
            f"the estimator's normalizer is zero or negative for {bad} of {total} queries ({why}); "
            "their outputs are not meaningful",
            NonPositiveDenominatorWarning,
            stacklevel=outside_stacklevel() if stacklevel is None else stacklevel,
        )
