r"""Oracle top-k attention, numpy float64 (the reference form).

Each query :math:`n` keeps the :math:`S` visible keys with the largest logits and attends to them exactly:

.. math::
    K_n = \operatorname{top}_S \{\, x_n^\top y_m : m \text{ visible to } n \,\}, \qquad
    \hat y_n = \sum_{m \in K_n} \frac{e^{x_n^\top y_m}}{\sum_{m' \in K_n} e^{x_n^\top y_{m'}}} v_m .

Ties between equal computed logits go to the lower key index (:mod:`randattn.estimators.topk` says when logits
equal in exact arithmetic are not); a query that sees at most :math:`S` keys keeps them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from randattn.estimators.masks import DECLARABLE_MASKS
from randattn.estimators.sparse.selection import (
    KeptKeysOptions, KeptKeysReference, deprecated_check_params, top_ranked,
)

__all__ = ["TopkOptions", "estimate", "keys_used", "kept_keys", "probabilities"]


@dataclass(frozen=True, kw_only=True)
class TopkOptions(KeptKeysOptions):
    """Top-k's keyword options: ``scale`` and ``mask`` only; S (``num_samples``, the keys each query keeps) comes
    with the draws and may be any positive integer. Every mask, a sliding window too: the S keys are ranked among
    the keys the query sees, whichever they are."""

    declared_masks: ClassVar[tuple[str | None, ...]] = DECLARABLE_MASKS


def kept_keys(x: np.ndarray, y: np.ndarray, logits: np.ndarray, budget: int, options: TopkOptions) -> np.ndarray:
    """``(..., N, M)`` boolean: the ``budget`` (S) largest visible logits of each query, ties to the lower index.

    The ``select`` of :class:`~randattn.estimators.sparse.selection.KeptKeysReference` (its arguments there): the
    mask is already applied to ``logits`` (``-inf`` where hidden), so hidden keys rank last and are never kept in
    place of a visible key.
    """
    return top_ranked(logits, budget)


estimate, probabilities, keys_used = KeptKeysReference(TopkOptions, kept_keys).forms()


def __getattr__(name: str) -> Any:
    if name == "check_params":  # deprecated: the options check themselves
        return deprecated_check_params(TopkOptions, "topk")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
