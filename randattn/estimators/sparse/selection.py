r"""Deterministic key selection (top-k, StreamingLLM, Quest): the budget in the draws and the estimator forms.

Each of these estimators decides, from the inputs, the mask and the budget :math:`S`, which keys each query keeps,
``keep : (..., N, M)`` boolean, and returns exact softmax attention over the kept keys it may see:

.. math::
    \hat y_n = \frac{\sum_{m \in K_n} e^{x_n^\top y_m} v_m}{\sum_{m \in K_n} e^{x_n^\top y_m}},

the weighted attention of :mod:`randattn.estimators.sparse` with :math:`\log w_{nm} = 0` for :math:`m \in K_n` and
:math:`-\infty` otherwise. They have no random variables: their draws carry :math:`S` only, as
``budget : (R, ...)`` (the same value for every replicate and batch element), and every replicate returns the
same output.

:class:`KeptKeysReference` turns an estimator's ``check`` (its parameters against S) and ``select`` (its rule
for ``keep``) into the numpy float64 ``estimate``, ``probabilities`` and ``keys_used``;
:class:`~randattn.estimators.sparse.batched_selection.KeptKeysBatched` does the same in torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from randattn._validation import check_choice, check_positive_int
from randattn.estimators._prepare import check_draw_array, prepare_reference
from randattn.estimators.base import MASKS, Draws
from randattn.estimators.sparse.reference import keys_used as count_keys_used
from randattn.estimators.sparse.reference import masked_logits, weighted_attention

__all__ = ["KeptKeysReference", "budget_draws", "budget_of", "log_weights_of", "top_ranked"]


def budget_draws(q_shape: Sequence[int], num_samples: Any, replicates: int) -> Draws:
    """``Draws({"budget": (R, ...)})`` holding S = ``num_samples`` (a positive integer) for every replicate and batch
    element: a replicate dim followed by the batch dims, as every draw, so that a sweep may slice them by cell."""
    budget = check_positive_int("num_samples", num_samples)
    return Draws({"budget": np.full((replicates, *q_shape[:-2]), float(budget))}, replicates)


def budget_of(draws: Draws, batch_shape: Sequence[int]) -> int:
    """S from draws made by :func:`budget_draws` for inputs with these batch dims (numpy, or torch on the CPU).

    Raises ValueError when the draws have another shape or do not hold one positive integer.
    """
    values = check_draw_array(draws, "budget", batch_shape, ())
    values = np.asarray(values.detach().cpu() if hasattr(values, "detach") else values, dtype=np.float64).ravel()
    budget = values[0]
    if not (np.all(values == budget) and budget >= 1 and budget == np.floor(budget)):
        raise ValueError(f"draws['budget'] must hold one positive integer S throughout, got {np.unique(values)}: "
                         "were the draws made by this estimator's draw()?")
    return int(budget)


def log_weights_of(keep: np.ndarray) -> np.ndarray:
    r""":math:`\log w`: 0 where ``keep`` (the key is computed exactly), ``-inf`` where the key is left out."""
    return np.where(keep, 0.0, -np.inf)


def top_ranked(scores: np.ndarray, count: int) -> np.ndarray:
    """``(..., L)`` boolean: the ``count`` largest ``scores`` of each row (all of them when ``count >= L``).

    Ties go to the lower index (a stable sort of ``-scores``), so the choice is a function of the values alone;
    ``-inf`` scores rank last.
    """
    order = np.argsort(-scores, axis=-1, kind="stable")[..., :count]
    keep = np.zeros(scores.shape, dtype=bool)
    np.put_along_axis(keep, order, True, axis=-1)
    return keep


def _replicated(array: np.ndarray, replicates: int) -> np.ndarray:
    return np.broadcast_to(array, (replicates, *array.shape)).copy()


@dataclass(frozen=True)
class KeptKeysReference:
    """The numpy float64 forms of a deterministic selection estimator.

    Attributes
    ----------
    check : callable
        ``check(budget, **params) -> None``: raises ValueError/TypeError naming a parameter outside its range.
    select : callable
        ``select(x, y, logits, budget, mask, **params) -> keep``: ``x : (..., N, D)``, ``y : (..., M, D)``, the
        masked logits ``(..., N, M)`` (``-inf`` where hidden); ``keep`` broadcasts against the logits. Kept
        hidden keys are dropped afterwards (their logit is ``-inf``).
    """

    check: Callable[..., None]
    select: Callable[..., np.ndarray]

    def forms(self) -> tuple[Callable[..., np.ndarray], ...]:
        """``(estimate, probabilities, keys_used)``, the module-level functions of an estimator's reference."""
        return self.estimate, self.probabilities, self.keys_used

    def _log_weights(self, q: Any, k: Any, v: Any, draws: Draws, scale: float | None, mask: str | None,
                     params: dict[str, Any]):
        check_choice("mask", mask, MASKS)
        x, y, v, _, batch = prepare_reference(q, k, v, scale)
        budget = budget_of(draws, batch)
        self.check(budget, **params)
        logits = masked_logits(x, y, mask)
        return logits, log_weights_of(self.select(x, y, logits, budget, mask, **params)), v

    def estimate(self, q: Any, k: Any, v: Any, draws: Draws, *, scale: float | None = None, mask: str | None = None,
                 **params: Any) -> np.ndarray:
        """``(R, ..., N, Dv)``: softmax attention over each query's kept visible keys (same in every replicate)."""
        logits, log_weights, v = self._log_weights(q, k, v, draws, scale, mask, params)
        out, _ = weighted_attention(logits, log_weights, v)
        return _replicated(out, draws.replicates)

    def probabilities(self, q: Any, k: Any, draws: Draws, *, scale: float | None = None, mask: str | None = None,
                      **params: Any) -> np.ndarray:
        """``(R, ..., N, M)``: the implied attention probabilities (zero off the kept visible keys)."""
        logits, log_weights, _ = self._log_weights(q, k, k[..., :1], draws, scale, mask, params)
        _, probabilities = weighted_attention(logits, log_weights, np.zeros((logits.shape[-1], 0)))  # no values
        return _replicated(probabilities, draws.replicates)

    def keys_used(self, q: Any, k: Any, draws: Draws, *, scale: float | None = None, mask: str | None = None,
                  **params: Any) -> np.ndarray:
        """``(R, ..., N)`` float64: the kept keys each query may see, i.e. the keys its estimate reads."""
        logits, log_weights, _ = self._log_weights(q, k, k[..., :1], draws, scale, mask, params)
        return _replicated(count_keys_used(log_weights, logits), draws.replicates)
