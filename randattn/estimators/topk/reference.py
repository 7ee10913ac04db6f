r"""Oracle top-k attention, numpy float64 (the reference form).

Each query :math:`n` keeps the :math:`S` visible keys with the largest logits and attends to them exactly:

.. math::
    K_n = \operatorname{top}_S \{\, x_n^\top y_m : m \text{ visible to } n \,\}, \qquad
    \hat y_n = \sum_{m \in K_n} \frac{e^{x_n^\top y_m}}{\sum_{m' \in K_n} e^{x_n^\top y_{m'}}} v_m .

Ties between equal logits go to the lower key index; a query that sees at most :math:`S` keys keeps them all.
"""

from __future__ import annotations

import numpy as np

from randattn._validation import check_positive_int
from randattn.estimators.sparse.selection import KeptKeysReference, top_ranked

__all__ = ["check_params", "estimate", "keys_used", "kept_keys", "probabilities"]


def check_params(budget: int | None) -> None:
    """S (``num_samples``, the keys each query keeps) must be a positive integer; any S >= 1 is allowed.
    ``budget=None``: S is not known here (batched draws on an accelerator), nothing to check."""
    if budget is not None:
        check_positive_int("num_samples", budget)


def kept_keys(x: np.ndarray, y: np.ndarray, logits: np.ndarray, budget: int, mask: str | None = None) -> np.ndarray:
    """``(..., N, M)`` boolean: the ``budget`` largest visible logits of each query, ties to the lower index.

    Parameters
    ----------
    x : (..., N, D)
    y : (..., M, D)
    logits : (..., N, M)
        :math:`x_n^\\top y_m`, ``-inf`` where the mask hides key m (hidden keys rank last, so they are never
        kept in place of a visible key).
    budget : int
        S, the keys kept per query.
    mask : {None, "causal"}
        Already applied to ``logits``.
    """
    return top_ranked(logits, budget)


estimate, probabilities, keys_used = KeptKeysReference(check_params, kept_keys).forms()
